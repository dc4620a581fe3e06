"""Where the engine's log lines go (pagednb/log.py): stderr in a terminal, stdout in a Jupyter kernel
(never the red stderr boxes), a user's own logging set-up left alone, and `set_log_level`; and the
start-up KV line saying why a pool is smaller than its memory budget."""
import io
import logging
import subprocess
import sys

import pytest

import pagednb
from pagednb import LLM, log


@pytest.fixture
def fresh_logger():
    """The "pagednb" logger without its handlers and level for one test, restored afterwards."""
    logger = logging.getLogger(log.LOGGER_NAME)
    saved = logger.handlers[:], logger.level
    logger.handlers.clear()
    yield logger
    logger.handlers[:], logger.level = saved[0], saved[1]


def test_in_a_terminal_the_lines_go_to_stderr():
    code = "import pagednb, logging; logging.getLogger('pagednb').info('hello from the engine')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip() == "[pagednb] hello from the engine" and done.stdout == ""


def test_in_a_jupyter_kernel_the_lines_go_to_the_stdout_of_the_moment(fresh_logger, monkeypatch):
    monkeypatch.setattr(log, "in_jupyter_kernel", lambda: True)
    log.configure_default_logging()
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)  # as ipykernel swaps in its own stream after the import
    monkeypatch.setattr(sys, "stderr", err)
    fresh_logger.info("KV cache: %d tokens", 4096)
    assert out.getvalue() == "[pagednb] KV cache: 4096 tokens\n" and err.getvalue() == ""


def test_pytest_is_not_a_jupyter_kernel():
    assert not log.in_jupyter_kernel()


def test_a_logger_the_user_configured_is_left_alone(fresh_logger):
    mine = logging.NullHandler()
    fresh_logger.addHandler(mine)
    fresh_logger.setLevel(logging.ERROR)
    log.configure_default_logging()
    assert fresh_logger.handlers == [mine] and fresh_logger.level == logging.ERROR


def test_set_log_level(fresh_logger):
    pagednb.set_log_level("warning")
    assert fresh_logger.level == logging.WARNING
    pagednb.set_log_level(logging.DEBUG)
    assert fresh_logger.level == logging.DEBUG
    with pytest.raises(ValueError, match="level must be one of .*'LOUD'"):
        pagednb.set_log_level("LOUD")
    with pytest.raises(TypeError, match="level must be one of"):
        pagednb.set_log_level(2.5)
    with pytest.raises(TypeError):
        pagednb.set_log_level(True)


def kv_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))


@pytest.mark.parametrize("options, capped", [({}, True), ({"kv_cache_memory": 2**22}, False),
                                             ({"num_kv_blocks": 64}, False)])
def test_the_kv_line_says_when_max_num_seqs_caps_the_pool(caplog, options, capped):
    """2 GiB (the CPU default) would hold far more than 256 requests of 512 tokens can use."""
    with caplog.at_level(logging.INFO, logger="pagednb"):
        with LLM(max_model_len=512, max_num_seqs=256, **options) as llm:
            blocks = llm.stats()["num_blocks"]
    line = kv_line(caplog)
    assert ("capped at max_num_seqs=256 x one max_model_len request" in line) == capped, line
    if capped:
        assert blocks == 256 * 512 // 16
