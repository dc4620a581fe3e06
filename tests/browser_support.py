"""Support for the real-browser test: a JupyterLab server started on localhost with no user state, and a
Debian Chromium driven by Playwright (never `playwright install`; the browser is the system's)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extras install it
    PlaywrightTimeoutError = sync_playwright = None

CHROMIUM = "/usr/bin/chromium"
# On a closed network Chromium's own background connections (updates, sync, safe browsing) are refused and
# can stall it; as root it needs --no-sandbox.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
REPO = Path(__file__).resolve().parent.parent
# every browser test module's pytestmark: slow, and skipped (saying why) without Playwright or the system browser
BROWSER_TEST_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="the playwright package is not installed "
                       "(pip install -e '.[test]'); the browser test needs it"),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (apt-get install chromium; "
                       ".ci/run does it); the browser test never downloads a browser"),
]
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never through a proxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


class JupyterLab:
    """`jupyter lab` on 127.0.0.1, a free port and a random token, serving `root_dir`; every Jupyter and
    IPython state directory is a fresh one under `state_dir`, so nothing of the user's leaks in. Its
    kernels inherit the environment (HF_HUB_OFFLINE=1, the repository on PYTHONPATH)."""

    def __init__(self, root_dir: Path, state_dir: Path) -> None:
        self.root_dir, self.state_dir = Path(root_dir), Path(state_dir)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.state_dir / "jupyterlab.log"

    def _env(self) -> dict:
        s = self.state_dir
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "IPYTHON"))}
        settings = s / "lab-settings"
        # no news / update-check toasts over the page; every cell in the DOM (no windowing); the notebook's
        # kernel starts without the "Select Kernel" dialog
        _write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                    {"fetchNews": "false", "checkForUpdates": False})
        _write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                    {"windowingMode": "none", "autoStartDefaultKernel": True})
        env.update(
            JUPYTER_CONFIG_DIR=str(s / "config"), JUPYTER_DATA_DIR=str(s / "data"),
            JUPYTER_RUNTIME_DIR=str(s / "runtime"), IPYTHONDIR=str(s / "ipython"),
            JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(s / "workspaces"),
            JUPYTER_PLATFORM_DIRS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        return env

    def start(self, timeout: float = 60.0) -> "JupyterLab":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root_dir}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: the test reads the notebook model
        log = open(self.log_path, "wb")
        # its own process group, so a failure can end the server and every kernel it started
        self.proc = subprocess.Popen(cmd, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root_dir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with _LOCAL.open(self.url("/api/status"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"jupyter lab did not answer /api/status within {timeout} s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}{path}{sep}token={self.token}"

    def api(self, method: str, path: str) -> object:
        req = urllib.request.Request(self.url(path), method=method)
        with _LOCAL.open(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Asks the server to shut down (it ends its kernels), then ends what is left of its process
        group: SIGTERM, and SIGKILL after a grace period."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.api("POST", "/api/shutdown")
            self.proc.wait(timeout=15)
        except Exception:
            pass
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        # kernels live in the same group; make sure none outlives the server
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def running_lab(root: Path, state: Path, artifacts: Path):
    """A started JupyterLab serving root; stopped afterwards, its log kept in artifacts (kept on failure)."""
    server = JupyterLab(root, state)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        artifacts.mkdir(parents=True, exist_ok=True)
        if server.log_path.exists():
            shutil.copy(server.log_path, artifacts / "jupyterlab.log")


def copy_notebooks(src: Path, dst: Path) -> Path:
    """A private copy of the notebooks folder, so running and saving never touches the repository."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return dst


USED_RE = re.compile(r"used\D{0,3}(\d+)")


def parse_used(text: str) -> int | None:
    m = USED_RE.search(text)
    return int(m.group(1)) if m else None


def wait_until(predicate, timeout: float, interval: float = 0.1, message="condition"):
    """Polls `predicate` until it returns something truthy; returns it, or raises AssertionError.
    `message` (a string, or a callable giving one at the time of failure) says what was awaited."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    what = message() if callable(message) else message
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
