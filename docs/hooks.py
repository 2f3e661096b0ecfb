"""MkDocs hooks (see mkdocs.yml): pages generated from the code at every build.

- ``configuration.md``: every field of :class:`kstore.Settings`, read with
  ``dataclasses.fields``, its ``#:`` doc comment read from kstore/settings.py with ``ast``,
  its ``KSTORE_*`` variable, and its ``kstore worker`` flag found by walking the click command.
- ``cli.md``: the ``--help`` of every ``kstore`` command.

And links from a page to a file of the repository outside docs/ (``../kstore/db/session.py``),
which the site does not hold, are shown as the file's path; a link to a file that does not
exist is left alone, so that the strict build fails on it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import click
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

import kstore.cli
import kstore.settings
from kstore.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
#: The ``[env KSTORE_...]`` note at the end of a flag's help.
ENV_NOTE = re.compile(r" ?\[env [^\]]*\]")
LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
#: What the ``KSTORE_*`` variables that are not settings are for (_FOREIGN_ENV in settings.py).
FOREIGN_ENV = {
    "KSTORE_DEBUG": "any value but empty or `0` is `kstore --debug`: tracebacks and debug logs",
    "KSTORE_CACHE_DIR": "where `kstore.dev.broker` keeps the Apache Kafka jars (default `~/.cache/kstore`)",
    "KSTORE_TEST_": "kstore's own test suite (e.g. `KSTORE_TEST_BOOTSTRAP=host:port` for an external broker)",
    "KSTORE_SIM_": "kstore's own simulation tests",
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "configuration.md", content=configuration_page()))
    files.append(File.generated(config, "cli.md", content=cli_page()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    docs_dir = Path(config.docs_dir).resolve()
    page_dir = (docs_dir / page.file.src_path).parent

    def outside(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(ROOT) or not path.exists():
            return match.group(0)
        shown = f"`{path.relative_to(ROOT).as_posix()}`"
        return shown if text.strip("`") == path.relative_to(ROOT).as_posix() else f"{text} ({shown})"

    return LINK.sub(outside, markdown)


# -- configuration.md -------------------------------------------------------


def doc_comments(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment lines (the Sphinx convention), read from the class's source."""
    lines, _ = inspect.getsourcelines(cls)
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)
    comments: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        found: list[str] = []
        index = stmt.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#:"):
            found.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if found:
            comments[stmt.target.id] = " ".join(found)
    return comments


def default_sources(cls: type) -> dict[str, str]:
    """Each default as written in the source, e.g. ``32 * 2**20``."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)
    sources: dict[str, str] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            sources[stmt.target.id] = ast.unparse(stmt.value)
    return sources


def default_of(f: dataclasses.Field[Any], source: str | None) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "unset"
    shown = f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'
    if source is not None and isinstance(value, int) and not isinstance(value, bool) and source != repr(value) \
            and source.replace("_", "") != repr(value):
        shown += f" (`{source}`)"
    return shown


def option_flags(param: click.Parameter) -> str:
    assert isinstance(param, click.Option)
    flags = " / ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
    if not param.is_flag and param.metavar:
        flags = flags[:-1] + f" {param.metavar}`"
    return flags + (" (repeatable)" if param.multiple else "")


def worker_flags() -> tuple[dict[str, list[str]], list[str]]:
    """``kstore worker``'s flags by the Settings field they set, and those that set none."""
    names = {f.name for f in dataclasses.fields(Settings)}
    by_field: dict[str, list[str]] = {}
    others: list[str] = []
    for param in kstore.cli.cli.commands["worker"].params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        name = param.name
        if name.endswith("_file") and name[: -len("_file")] in kstore.settings.SECRETS:
            name = name[: -len("_file")]
        if name in names:
            by_field.setdefault(name, []).append(option_flags(param))
        else:
            others.append(option_flags(param))
    return by_field, others


def variables_of(f: dataclasses.Field[Any]) -> str:
    if f.name == "kafka_options":
        return f"`{kstore.settings.KAFKA_ENV_PREFIX}<NAME>`"
    name = f"`{kstore.settings.ENV_PREFIX}{f.name.upper()}`"
    if f.name in kstore.settings.SECRETS:
        name += f", `{kstore.settings.ENV_PREFIX}{f.name.upper()}_FILE`"
    if str(f.type).startswith("tuple"):
        name += " (comma-separated)"
    return name


def worker_helps() -> dict[str, tuple[str, str]]:
    """``kstore worker``'s help texts (without the ``[env ...]`` note) by field, with the flag."""
    helps: dict[str, tuple[str, str]] = {}
    for param in kstore.cli.cli.commands["worker"].params:
        if isinstance(param, click.Option) and param.name is not None and param.help:
            text = ENV_NOTE.sub("", param.help).strip()
            if text:
                helps.setdefault(param.name, (param.opts[0], text))
    return helps


def meaning(name: str, comments: dict[str, str], helps: dict[str, tuple[str, str]]) -> str:
    """The field's ``#:`` comment; without one, its flag's help (labelled); else a visible gap."""
    if name in comments:
        return comments[name]
    if name in helps:
        flag, text = helps[name]
        return f"{text} (`{flag}`'s help; no doc comment)"
    return "*(no doc comment)*"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def commands_taking(param_name: str) -> list[str]:
    return [path for path, cmd in walk_commands() if any(p.name == param_name for p in cmd.params)]


def configuration_page() -> str:
    comments = doc_comments(Settings)
    sources = default_sources(Settings)
    flags, unmapped = worker_flags()
    helps = worker_helps()
    rows = []
    for f in dataclasses.fields(Settings):
        kind = cell(str(f.type).replace(" | ", " or "))
        rows.append(f"| `{f.name}` | {kind} | {cell(default_of(f, sources.get(f.name)))} | {variables_of(f)} | "
                    f"{cell('<br>'.join(flags.get(f.name, [])))} | {cell(meaning(f.name, comments, helps))} |")
    prefix = kstore.settings.ENV_PREFIX
    secrets = ", ".join(f"`{prefix}{s.upper()}_FILE`" for s in kstore.settings.SECRETS)
    log_format = next(p for p in kstore.cli.cli.params if p.name == "log_format")
    assert isinstance(log_format, click.Option)
    choices = getattr(log_format.type, "choices", ())
    foreign = getattr(kstore.settings, "_FOREIGN_ENV", ())
    others = [f"- `{name}`{'*' if name.endswith('_') else ''}: {FOREIGN_ENV.get(name, 'read by kstore tooling')}"
              for name in foreign if name != log_format.envvar]
    connection = ", ".join(f"`{path}`" for path in commands_taking("bootstrap_servers") if path != "kstore worker")
    return "\n".join([
        "# Configuration",
        "",
        "<!-- Generated by docs/hooks.py from kstore/settings.py and the kstore command at every build. -->",
        "",
        "A worker's configuration is one frozen `kstore.Settings` object. Every field can be given",
        f"as a `{prefix}<NAME>` variable (read by `Settings.from_env()`, which `kstore worker` and every",
        "other command use), as the `kstore worker` flag where there is one (a flag wins over a variable),",
        "or as an argument from Python: `Settings.from_env(max_batch_size=1000)` or `Settings(...)`.",
        f"An unknown `{prefix}*` variable is an error, so a typo is never silently ignored.",
        "Numbers are parsed as the field's type; a `bool` takes `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`.",
        "",
        "A processor's own `group`, `topics`, `on_error` and `retry.max_attempts` are defaults that",
        "the settings of the same name override when set.",
        "",
        "| Setting | Type | Default | Variable | `kstore worker` flag | Meaning |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        *([f"`kstore worker` flags that set no field: {', '.join(unmapped)}.", ""] if unmapped else []),
        f"The brokers' connection flags (`--bootstrap-servers` to `--kafka-option`) are also taken by {connection}.",
        "",
        "## Other variables",
        "",
        f"- `{kstore.settings.KAFKA_ENV_PREFIX}<NAME>`: sets kafka-python's consumer option `<name>` (lower-cased),",
        "  e.g. `KSTORE_KAFKA_FETCH_MAX_BYTES=1048576`; added to `kafka_options`. An unknown option, or one",
        "  kstore sets itself (`group_id`, `enable_auto_commit`, `group_instance_id`, ...), is an error.",
        "  `isolation_level` is `read_committed` unless given (`KSTORE_KAFKA_ISOLATION_LEVEL=read_uncommitted`",
        "  also delivers records of aborted upstream transactions).",
        f"- {secrets}: read the secret from this file (the container convention; a trailing newline is",
        "  dropped), instead of the variable itself. Giving both is an error. The flags are",
        "  `--dsn-file`, `--sasl-password-file` and `--ssl-key-password-file`.",
        f"- `{log_format.envvar}` (`kstore {' '.join(log_format.opts)}`): {' or '.join(f'`{c}`' for c in choices)},"
        f" default `{log_format.default}`. {cell(ENV_NOTE.sub('', log_format.help or ''))}",
        "",
        "Read by tools around kstore, not by `Settings` (so never an unknown-variable error):",
        "",
        *others,
        "",
    ])


# -- cli.md -----------------------------------------------------------------


def walk_commands() -> list[tuple[str, click.Command]]:
    """Every command under ``kstore``, depth first, as ``(path, command)``."""
    found: list[tuple[str, click.Command]] = []

    def visit(path: str, cmd: click.Command) -> None:
        found.append((path, cmd))
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                visit(f"{path} {name}", cmd.commands[name])

    visit("kstore", kstore.cli.cli)
    return found


def help_text(path: str) -> str:
    """The command's ``--help``, as ``kstore ... --help`` prints it, 100 columns wide."""
    names = path.split()
    ctx = click.Context(kstore.cli.cli, info_name=names[0], terminal_width=100, max_content_width=100)
    for name in names[1:]:
        group = ctx.command
        assert isinstance(group, click.Group)
        ctx = click.Context(group.commands[name], info_name=name, parent=ctx, terminal_width=100,
                            max_content_width=100)
    return ctx.command.get_help(ctx)


def cli_page() -> str:
    parts = [
        "# CLI reference",
        "",
        "<!-- Generated by docs/hooks.py from the kstore command (kstore/cli.py) at every build. -->",
        "",
        "The `--help` of every `kstore` command. Every setting a flag sets can also come from a",
        "`KSTORE_*` variable: see [Configuration](configuration.md).",
        "",
    ]
    for path, _ in walk_commands():
        parts += [f"## `{path}`", "", "```text", help_text(path), "```", ""]
    return "\n".join(parts)
