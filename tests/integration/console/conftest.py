"""The console's browser fixtures: a headless Chromium, and ``kstore console`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import ConsoleProcess, start_browser


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = start_browser(tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def console(tmp_path: Path, kafka: str) -> Iterator[Callable[..., ConsoleProcess]]:
    started: list[ConsoleProcess] = []

    def start(dsn: str, group: str, *args: str) -> ConsoleProcess:
        started.append(ConsoleProcess(tmp_path, dsn, kafka, group, *args))
        return started[-1]

    yield start
    for proc in started:
        proc.stop()
