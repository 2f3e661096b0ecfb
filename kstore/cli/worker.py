"""``kstore worker``: parses its options, builds Settings, runs a :class:`~kstore.engine.worker.Worker`;
``kstore relay``: runs a :class:`~kstore.relay.loop.Relay` on its own.

The worker installs no signal handlers itself; this command wires them: the first SIGTERM or
SIGINT asks the worker to stop after the batch in flight (bounded by ``shutdown_timeout_s``),
a second one stops it at once. Signals run on the main thread, where the batches run.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import Any

import click

from kstore.cli.common import (
    LOG_CONTEXT,
    dsn_option,
    kafka_connection_options,
    log,
    run,
    schema_registry_options,
    stop_on_signals,
)
from kstore.db.migration import check_migrated
from kstore.db.store import Store, make_engine
from kstore.engine.worker import Worker
from kstore.relay.loop import Relay
from kstore.running.loading import load_processor
from kstore.settings import Settings
from kstore.telemetry.health import HealthServer, app


@click.command()
@click.argument("processor")
@dsn_option
@kafka_connection_options
@schema_registry_options
@click.option("--group", default=None, help="Pipeline name (Kafka group id); overrides the processor's.")
@click.option("--topic", "topics", multiple=True, help="Topic to consume (repeatable); overrides the processor's.")
@click.option("--rebalance-protocol", type=click.Choice(["eager", "cooperative", "consumer"], case_sensitive=False),
              default=None, help="How the group rebalances: eager, cooperative (cooperative-sticky) or consumer "
                                 "(KIP-848); the last two with --kafka-client confluent "
                                 "[env KSTORE_REBALANCE_PROTOCOL; default eager]")
@click.option("--start-from", default=None, help="earliest, latest or ISO 8601 time, if no stored offset.")
@click.option("--max-batch-size", type=int, default=None, help="Most messages per transaction.")
@click.option("--on-error", type=click.Choice(["stop", "dead_letter"]), default=None,
              help="After the last attempt: stop, or dead-letter the message; overrides the processor's.")
@click.option("--max-attempts", type=int, default=None, help="Attempts per failing message; overrides the processor's.")
@click.option("--dead-letter-topic", default=None, metavar="TOPIC",
              help="Also produce each dead letter to this Kafka topic, exactly once; overrides the processor's "
                   "(\"\" for none) [env KSTORE_DEAD_LETTER_TOPIC]")
@click.option("--max-consecutive-dead-letters", type=int, default=None,
              help="Messages in a row dead-lettered after every attempt failed, none handled between, that trip "
                   "the dead-letter breaker; 0: never [env KSTORE_MAX_CONSECUTIVE_DEAD_LETTERS; default 20]")
@click.option("--max-consecutive-rejects", type=int, default=None,
              help="The same for messages rejected (Reject, give_up_on, not deserializable); 0: never "
                   "[env KSTORE_MAX_CONSECUTIVE_REJECTS; default 1000]")
@click.option("--dead-letter-breaker", type=click.Choice(["stop", "pause"]), default=None,
              help="A tripped breaker stops the worker (exit 1) or pauses it (unready until restarted) "
                   "[env KSTORE_DEAD_LETTER_BREAKER; default stop]")
@click.option("--max-concurrency", type=int, default=None,
              help="Async processors: most messages of a batch handled at once; overrides the processor's.")
@click.option("--ordering", type=click.Choice(["key", "partition", "none"]), default=None,
              help="Async processors: which messages run one after another; overrides the processor's.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve /metrics, /livez and /readyz on this port [env KSTORE_METRICS_PORT; default off]")
@click.option("--metrics-host", default=None, metavar="ADDRESS",
              help="The address the metrics port listens on, e.g. 127.0.0.1 for this host only "
                   "[env KSTORE_METRICS_HOST; default 0.0.0.0, every interface, as Kubernetes probes need]")
@click.option("--topic-recheck-s", type=float, default=None, metavar="SECONDS",
              help="How long a produced-to topic's existence is trusted before it is looked up again "
                   "[env KSTORE_TOPIC_RECHECK_S; default 10]")
@click.option("--relay/--no-relay", default=None,
              help="Publish what the processor produces from this worker [default: on]; turn it off where "
                   "`kstore relay` runs apart.")
@click.pass_context
def worker(ctx: click.Context, /, processor: str, **options: Any) -> None:
    """Run PROCESSOR (MODULE:CLASS) until SIGTERM/SIGINT, exactly once."""
    topics = options.pop("topics")

    def start(settings: Settings) -> None:
        sys.path.insert(0, os.getcwd())
        w = Worker(load_processor(processor), settings)
        LOG_CONTEXT.group = w.group
        _run_worker(w, settings.shutdown_timeout_s)

    run(ctx, lambda: Settings.from_env(topics=tuple(topics) or None, **options), start)


@click.command()
@click.option("--group", default=None,
              help="The pipeline (Kafka group id) whose outbox to publish (made with outbox_shards if its "
                   "workers have not made it yet).")
@click.option("--outbox", default=None,
              help="An application's outbox (kstore.outbox.Outbox) by its name: waited for until the "
                   "application sets it up, unless --create.")
@click.option("--create", is_flag=True,
              help="With --outbox: make the outbox if it does not exist yet (--shards of them), rather than wait "
                   "for the application.")
@click.option("--shards", type=click.IntRange(min=1), default=None,
              help="With --create: the shards it makes [env KSTORE_OUTBOX_SHARDS; default 1]")
@dsn_option
@kafka_connection_options
@click.option("--metrics-port", type=int, default=None,
              help="Serve /metrics, /livez and /readyz on this port [env KSTORE_METRICS_PORT; default off]")
@click.option("--metrics-host", default=None, metavar="ADDRESS",
              help="The address the metrics port listens on [env KSTORE_METRICS_HOST; default 0.0.0.0]")
@click.pass_context
def relay(ctx: click.Context, /, **options: Any) -> None:
    """Publish an outbox to Kafka until SIGTERM/SIGINT: a group's (what its processor produced), or an
    application's (--outbox NAME, what kstore.outbox.Outbox produced in its transactions).

    Workers publish their own group's outbox by default; run this apart (with ``kstore worker
    --no-relay``, or beside them) to scale publishing apart. Relays of one outbox share its
    shards; each shard has one publisher at a time, fenced in the database and in Kafka. An
    application's outbox is made by the application (its shard count is the application's): the
    relay waits for it, and /readyz says so, unless --create.
    """
    name, wait = _relay_target(options)

    def start(settings: Settings) -> None:
        engine = make_engine(settings)
        try:
            store = Store(engine, settings)
            store.check_reachable()
            check_migrated(engine, settings)
            LOG_CONTEXT.group = settings.group
            r = Relay(settings, name, engine, wait_for_outbox=wait)
            stop_on_signals(r.request_stop, "finishing the transactions in flight, then giving the outbox's shards up")
            http = None
            if settings.metrics_port is not None:
                http = HealthServer(settings.metrics_host, settings.metrics_port,
                                    app(r.metrics.registry, r.liveness, r.readiness)).start()
                log.info("serving /metrics, /livez and /readyz on http://%s:%d", settings.metrics_host, http.port)
            try:
                r.run()
            finally:
                if http is not None:
                    http.stop()
        finally:
            engine.dispose()

    run(ctx, lambda: Settings.from_env(**options), start)


def _relay_target(options: dict[str, Any]) -> tuple[str, bool]:
    """The outbox ``kstore relay`` publishes, and whether it waits for its application to make it; its
    own options are taken out of ``options`` (``--shards`` becomes ``outbox_shards``)."""
    group, outbox, create, shards = (options.pop(k) for k in ("group", "outbox", "create", "shards"))
    if (group is None) == (outbox is None):
        raise click.UsageError("give --group GROUP (a pipeline's outbox) or --outbox NAME (an application's)")
    if outbox is None and (create or shards is not None):
        raise click.UsageError("--create and --shards are for --outbox NAME: a group's outbox is made with "
                               "outbox_shards")
    if shards is not None and not create:
        raise click.UsageError("--shards is the count --create makes: give --create too (without it the "
                               "application makes the outbox)")
    options["group"], options["outbox_shards"] = group or outbox, shards
    return str(group or outbox), outbox is not None and not create


class _ShutdownTimeout(BaseException):
    """Raised in the main thread when the batch in flight outlives ``shutdown_timeout_s``.

    A BaseException, so that no ``except Exception`` (the processor's or kstore's)
    swallows it: it unwinds the batch, whose transaction rolls back.
    """


class _ForcedExit(BaseException):
    """Raised in the main thread by a second SIGTERM/SIGINT."""


def _install_signals(w: Worker, timeout_s: float) -> None:
    """First SIGTERM/SIGINT: finish the batch in flight (for at most ``timeout_s``), commit it, leave.
    Second: stop at once; the batch in flight rolls back, nothing partial is committed."""
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            raise _ForcedExit(128 + signum)
        log.info("%s received: finishing the batch in flight (at most %gs), then leaving the group",
                 signal.Signals(signum).name, timeout_s)
        w.request_stop()
        # Then every second: a batch that starts after the first alarm (or is between
        # statements then) is still bounded.
        signal.setitimer(signal.ITIMER_REAL, timeout_s, 1.0)

    def on_alarm(_signum: int, _frame: Any) -> None:
        if w.busy:  # otherwise the loop is already on its way out: let it leave the group cleanly
            raise _ShutdownTimeout()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGALRM, on_alarm)


def _run_worker(w: Worker, timeout_s: float) -> None:
    _install_signals(w, timeout_s)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: for a worker that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        w.run()
    except _ShutdownTimeout:
        log.warning("the batch in flight did not finish within %gs of the stop signal: rolled back, "
                    "it will be processed again after a restart", timeout_s)
    except _ForcedExit as exc:
        log.warning("second stop signal: stopped at once; the batch in flight was rolled back")
        sys.exit(exc.args[0])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
