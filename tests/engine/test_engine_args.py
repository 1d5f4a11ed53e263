"""EngineArgs: one set of engine defaults behind LLM(...), `kdaserve serve` and `generate`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict, fields

import pytest

import kdaserve.engine.llm as llm_module
from kdaserve.cli import build_parser
from kdaserve.config import EngineConfig
from kdaserve.engine.args import EngineArgs
from kdaserve.engine.engine_flags import add_engine_arguments, flag_name
from kdaserve.server import args as server_args
from kdaserve.server.cli import add_serve_arguments


class _Captured(Exception):
    pass


def _llm_config(monkeypatch: pytest.MonkeyPatch, *args, **kwargs) -> EngineConfig:
    """The EngineConfig LLM(...) builds, without loading a model."""
    seen: list[EngineConfig] = []

    def engine_core(config, **_):
        seen.append(config)
        raise _Captured

    monkeypatch.setattr(llm_module, "EngineCore", engine_core)
    with pytest.raises(_Captured):
        llm_module.LLM(*args, **kwargs)
    return seen[0]


def _serve_namespace(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_llm_and_serve_defaults_agree(monkeypatch):
    offline = _llm_config(monkeypatch)
    served = EngineArgs.from_cli(_serve_namespace([])).to_engine_config()
    assert offline == served
    assert offline.cache.cache_memory_bytes == 512 << 20      # the one default (was 256 in LLM)


def test_generate_defaults_agree_with_llm(monkeypatch):
    ns = build_parser().parse_args(["generate", "hello"])
    assert EngineArgs.from_cli(ns).to_engine_config() == _llm_config(monkeypatch)


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs):
        assert f.name in by_dest, f.name
        assert flag_name(f.name) in by_dest[f.name].option_strings
        assert by_dest[f.name].help


@pytest.mark.parametrize("argv,check", [
    (["--max-model-len", "1024"], lambda c: c.scheduler.max_model_len == 1024),
    (["--cache-memory", "64MiB"], lambda c: c.cache.cache_memory_bytes == 64 << 20),
    (["--no-prefix-caching"], lambda c: not c.cache.enable_prefix_caching),
    (["--torch-threads", "3"], lambda c: c.num_threads == 3),
    (["--num-threads", "3"], lambda c: c.num_threads == 3),
    (["--speculative-method", "ngram", "--speculative-tokens", "3"],
     lambda c: (c.speculative.method, c.speculative.num_speculative_tokens) == ("ngram", 3)),
    (["--speculative-method", "dspark", "--no-speculative-adaptive"],
     lambda c: not c.speculative.adaptive),
    (["--state-snapshot-budget", "0.25", "--cache-memory", "64MiB"],
     lambda c: c.cache.state_snapshot_budget_bytes == 16 << 20),
    (["--offload", "host,disk", "--offload-dir", "/tmp/x", "--offload-bytes", "1GiB"],
     lambda c: (c.cache.offload_tiers, c.cache.offload_bytes) == (("host", "disk"), (1 << 30,))),
    (["--tensor-parallel-size", "2", "--distributed-executor", "mp"],
     lambda c: (c.parallel.tensor_parallel_size, c.parallel.executor) == (2, "mp")),
    (["--num-blocks", "40", "--block-size", "32"],
     lambda c: (c.cache.num_blocks, c.cache.block_size) == (40, 32)),
])
def test_flag_round_trips_into_engine_config(argv, check):
    config = EngineArgs.from_cli(_serve_namespace(argv)).to_engine_config()
    assert check(config)


def test_cli_and_kwargs_build_the_same_config(monkeypatch):
    argv = ["--max-num-seqs", "8", "--long-prefill-token-threshold", "7", "--offload", "host",
            "--kda-chunk-size", "8", "--seed", "5"]
    served = EngineArgs.from_cli(_serve_namespace(argv)).to_engine_config()
    offline = _llm_config(monkeypatch, max_num_seqs=8, long_prefill_token_threshold=7,
                          offload="host", kda_chunk_size=8, seed=5)
    assert served == offline


def test_long_prefill_threshold_reaches_the_server_config(monkeypatch):
    from kdaserve.server import cli as server_cli

    seen: list[EngineConfig] = []

    async def serve(args, config, *rest):
        seen.append(config)
        return 0

    monkeypatch.setattr(server_cli, "_serve", serve)
    assert server_cli.main(["--long-prefill-token-threshold", "7"]) == 0   # the bundled model
    assert seen[0].scheduler.long_prefill_token_threshold == 7


def test_unknown_llm_kwarg_is_a_type_error():
    with pytest.raises(TypeError, match="LLM\\(\\).*'max_model_length'"):
        llm_module.LLM(max_model_length=10)


def test_kwargs_round_trip_through_asdict():
    args = EngineArgs(max_model_len=100, offload=("host",), enable_prefix_caching=True)
    assert EngineArgs.from_kwargs(**asdict(args)) == args


def test_generate_keeps_its_sampling_seed():
    ns = build_parser().parse_args(["generate", "hi", "--seed", "3", "--max-model-len", "64"])
    assert ns.sampling_seed == 3
    engine = EngineArgs.from_cli(ns)
    assert (engine.seed, engine.max_model_len) == (0, 64)


def test_engine_flags_on_a_group_skip_excluded_fields():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser.add_argument_group("engine"), exclude=("seed",))
    assert "seed" not in vars(parser.parse_args([]))


def test_serve_defaults_repeated_without_imports_agree():
    from kdaserve.arg_types import parse_size
    from kdaserve.server.app import DEFAULT_MAX_BODY_BYTES

    assert parse_size(server_args.DEFAULT_MAX_BODY_SIZE) == DEFAULT_MAX_BODY_BYTES


def test_serve_parser_loads_neither_torch_nor_the_web_stack():
    code = ("import argparse, sys; from kdaserve.server.args import add_serve_arguments; "
            "add_serve_arguments(argparse.ArgumentParser()); print(sorted(m for m in "
            "('fastapi', 'numpy', 'torch', 'uvicorn', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    from kdaserve.engine.args import EngineArgs

    assert EngineArgs().dtype == "auto"
    assert EngineArgs().to_engine_config().dtype == "float32"
    assert EngineArgs(device="cuda").to_engine_config().dtype == "bfloat16"
    assert EngineArgs(device="cuda:1").to_engine_config().dtype == "bfloat16"
    assert EngineArgs(device="cuda", dtype="float32").to_engine_config().dtype == "float32"


def test_packed_int_weights_on_cpu_run_in_float32(monkeypatch, tmp_path, caplog):
    """INT8/INT4 weights on CPU take the packed kernels' float32 activations: an explicit
    bfloat16 (on load or a compressed-tensors checkpoint) becomes float32 with a warning;
    unpacked models and CUDA keep what was asked for."""
    import json

    from kdaserve.engine.dtypes import packed_int_weights, resolve_dtype

    with caplog.at_level("WARNING", logger="kdaserve"):
        cfg = _llm_config(monkeypatch, dtype="bfloat16", quantization="int4")
    assert cfg.dtype == "float32"
    assert "taken as float32" in caplog.text
    assert _llm_config(monkeypatch, dtype="bfloat16").dtype == "bfloat16"
    assert resolve_dtype("bfloat16", "cuda", packed=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu", packed=True) == "float32"
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": ct}))
    assert packed_int_weights(None, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8"}}))
    assert not packed_int_weights(None, tmp_path)
    assert not packed_int_weights(None, tmp_path / "missing")
    assert packed_int_weights("int8", tmp_path / "missing")
