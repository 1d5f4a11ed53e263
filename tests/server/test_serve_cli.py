"""`kdaserve serve` arguments and the errors it reports before serving."""

from __future__ import annotations

import argparse
import json
import logging
import shutil

import pytest

from kdaserve.assets import DEMO_MODEL_DIR
from kdaserve.server.cli import (
    add_serve_arguments,
    load_generation_defaults,
    main,
    parse_size,
    served_model_name,
)


@pytest.mark.parametrize("text,size", [("1024", 1024), ("256MiB", 256 << 20), ("1GiB", 1 << 30),
                                       ("1.5G", 3 << 29), ("2 kb", 2000), ("64KiB", 64 << 10)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5MiB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_every_flag_has_help_and_defaults():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in flags)
    args = parser.parse_args([])
    assert (args.host, args.port, args.max_waiting, args.cache_memory) == (
        "127.0.0.1", 8000, 1024, 512 << 20)
    assert (args.request_timeout, args.shutdown_timeout, args.max_seqs_per_request) == (
        600.0, 30.0, 128)
    assert args.model is None


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KDASERVE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).api_key == "from-env"
    assert parser.parse_args(["--api-key", "flag"]).api_key == "flag"


def test_served_model_name(tmp_path):
    assert served_model_name(DEMO_MODEL_DIR) == "kdaserve-demo"
    assert served_model_name(tmp_path / "my-model") == "my-model"
    assert served_model_name(tmp_path, "custom") == "custom"


def test_bad_model_path_exits_2(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="kdaserve"):
        assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no config.json" in caplog.text


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-num-seqs", "0"],
                                  ["--cache-memory", "lots"], ["--dtype", "int4"]])
def test_bad_flag_values_are_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_bad_block_size_exits_2(tiny_model_dir, caplog):
    with caplog.at_level(logging.ERROR, logger="kdaserve"):
        assert main(["--model", str(tiny_model_dir), "--block-size", "12"]) == 2
    assert "block_size must be a positive power of two" in caplog.text


def test_bad_generation_config_exits_2(tiny_model_dir, tmp_path, caplog):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with caplog.at_level(logging.ERROR, logger="kdaserve"):
        assert main(["--model", str(tmp_path)]) == 2
    assert "generation_config.json: top_p must be in (0, 1]" in caplog.text


def test_generation_defaults_are_loaded(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_k": 40, "do_sample": True, "eos_token_id": 0}))
    assert load_generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 40}
