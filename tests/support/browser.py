"""Driving ``kstore console`` in a real headless Chromium (Debian's, through its chromedriver).

No browser is downloaded: Selenium is given /usr/bin/chromium and /usr/bin/chromedriver, which
scripts/setup installs. Without them the tests that use this fail; they never skip.
Set KSTORE_TEST_SCREENSHOTS=DIR to keep a screenshot of each page there (docs/ takes them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.harness import REPO_DIR, SUPPORT_DIR, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
PASSWORD = "console-test-Pw"
#: How the browser runs on these machines (no GPU, no sandbox as root, nothing fetched in the background).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ConsoleProcess:
    """``kstore console`` in a subprocess, with the test processors importable (to replay)."""

    def __init__(self, tmp_path: Path, dsn: str, kafka: str, group: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        password_file = tmp_path / "console-password"
        password_file.write_text(PASSWORD + "\n")
        self.log_path = tmp_path / "console.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kstore", "console", "--dsn", dsn, "--bootstrap-servers", kafka,
             "--port", str(self.port), "--password-file", str(password_file), "--sample-interval", "1", *args],
            cwd=SUPPORT_DIR, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "KSTORE_GROUP": group,
                 "PYTHONPATH": os.pathsep.join([str(SUPPORT_DIR), str(REPO_DIR)])})
        wait_until(self._up, 60, what=f"the console at {self.url}\n{self.log_path.read_text()}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the console exited ({self.proc.returncode}):\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/login", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def shot(browser: WebDriver, name: str) -> None:
    folder = os.environ.get("KSTORE_TEST_SCREENSHOTS")
    if folder:
        browser.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def log_in(browser: WebDriver, url: str, name: str) -> None:
    browser.get(url + "/")
    assert "/login" in browser.current_url  # every page wants a login first
    browser.find_element(By.NAME, "operator").send_keys(name)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    click(browser, browser.find_element(By.CSS_SELECTOR, "#login button"))
    assert browser.find_element(By.ID, "operator").text == name


def click(browser: WebDriver, element: WebElement) -> None:
    """Click what submits a form or follows a link, and wait for the next page: a click returns
    before the browser has left the page it was on."""
    page = browser.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(browser, 30).until(expected_conditions.staleness_of(page))
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")


def page_text(browser: WebDriver) -> str:
    text: str = browser.find_element(By.TAG_NAME, "body").text
    return text




def start_browser(profile: Path) -> WebDriver:
    """A headless Chromium with its own profile folder; quit it when done."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    return driver
