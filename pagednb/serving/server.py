"""`Server`: the OpenAI-compatible app on a port, run by uvicorn where the engine already lives.

In a notebook, `llm.serve()` schedules `uvicorn.Server.serve()` as a task on the kernel's running loop:
no thread, no second copy of the model. The server's requests become streams on the same engine driver
as the cell's own `llm.stream`, and a cell's synchronous `llm.generate` steps the engine for everyone
(engine/driver.py), so the server's requests keep advancing while it runs; their chunks go out when the
cell returns the loop. With no running loop (a plain script) the same server runs on an event loop of
its own in a daemon thread, the one case with a thread; the engine is still the same object, and steps
from either thread are serialised by the driver's lock. `pagednb serve` runs it in the foreground
(`serve_forever`).

The socket is bound before `serve` returns: a port in use raises OSError in the caller's cell (not a
SystemExit inside a task), port=0 picks a free port, and `.url` is right at once. The kernel's signal
handlers are left alone (uvicorn would take over SIGINT, which is how Jupyter interrupts a cell).
"""
from __future__ import annotations

import asyncio
import contextlib
import html
import ipaddress
import logging
import socket
import threading

import uvicorn

from pagednb.serving.app import create_app

logger = logging.getLogger("pagednb")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, minus its signal handling when it runs inside someone else's program."""

    def __init__(self, config: uvicorn.Config, handle_signals: bool) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self):
        if self.handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


class Server:
    """A running OpenAI-compatible server for one LLM. `.url`, `.model_name`, `stop()`."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 model_name: str | None = None) -> None:
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if not _is_loopback(host) and api_key is None:
            logger.warning("Serving on %s without an api_key: anyone who can reach this address can use the "
                           "model. Pass api_key=... (or bind 127.0.0.1).", host)
        self.llm = llm
        self.model_name = model_name or _default_model_name(llm)
        self.host = host
        self.app = create_app(llm, self.model_name, api_key)
        self._socket = _bind(host, port)
        self.port = self._socket.getsockname()[1]
        self._config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._uvicorn: _Uvicorn | None = None  # made by start() or serve_forever()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL for OpenAI clients (`OpenAI(base_url=server.url, api_key=...)`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return (self._task is not None and not self._task.done()) or (
            self._thread is not None and self._thread.is_alive())

    # ---- starting --------------------------------------------------------------------------------
    def start(self) -> Server:
        """Serves in the background and returns at once: a task on the running loop, or else a thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._uvicorn = _Uvicorn(self._config, handle_signals=False)
        if loop is not None:
            self._task = loop.create_task(self._uvicorn.serve(sockets=[self._socket]), name="pagednb-server")
            self._task.add_done_callback(_log_failure)
        else:
            self._thread = threading.Thread(target=asyncio.run, args=(self._uvicorn.serve(sockets=[self._socket]),),
                                            name="pagednb-server", daemon=True)
            self._thread.start()
        return self

    async def serve_forever(self) -> None:
        """Serves in the foreground until SIGINT/SIGTERM (the `pagednb serve` command)."""
        self._uvicorn = _Uvicorn(self._config, handle_signals=True)
        await self._uvicorn.serve(sockets=[self._socket])

    # ---- stopping --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stops accepting connections and shuts down once the responses under way have ended (at the
        loop's next turns, in a notebook). A thread-run server is joined here."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        else:
            self._socket.close()  # never started
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    async def wait_stopped(self) -> None:
        """Awaits the end of a server started on this loop (after stop())."""
        if self._task is not None:
            await asyncio.shield(self._task)

    # ---- display ---------------------------------------------------------------------------------
    def __repr__(self) -> str:
        state = "serving" if self.running else "stopped"
        return f"pagednb server {state} at {self.url} (model {self.model_name!r})"

    def _repr_html_(self) -> str:
        state = "serving" if self.running else "stopped"
        return (f"<code>pagednb</code> {state} OpenAI API at <a href='{html.escape(self.url)}/models' target='_blank'>"
                f"{html.escape(self.url)}</a>, model <code>{html.escape(self.model_name)}</code>")


def _default_model_name(llm) -> str:
    """The model as the user named it (vLLM's rule); the embedded model is "default_model"."""
    from pagednb.llm import DEFAULT_MODEL

    model = llm.engine.config.model
    return DEFAULT_MODEL.name if model == str(DEFAULT_MODEL) else model


def announce(server: Server) -> None:
    """The one-line status: displayed in a notebook (HTML, with a link), logged elsewhere."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and hasattr(shell, "kernel"):
        from IPython.display import display
        display(server)
    else:
        logger.info("Serving %r at %s (OpenAI API)", server.model_name, server.url)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("The pagednb server stopped with an error", exc_info=task.exception())
