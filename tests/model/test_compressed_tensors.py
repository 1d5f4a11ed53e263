"""Independence: a checkpoint quantized by the `compressed-tensors` package itself (its
qparams, its quantize, its int32 packing, its config) loads into kdaserve; logits equal the
float model holding the package's own dequantized weights, greedy tokens match. And the
other way: what `kdaserve quantize` writes, the package decompresses to kdaserve's weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_model, tiny_config

from kdaserve.model.loader import load_model, save_model
from kdaserve.model.quant_linear import QuantLinear

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import (
    PackedQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized.helpers import (
    unpack_from_int32,
)
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams

CFG = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
       "kv_lora_rank": 32}
# the linears of a Kimi Linear checkpoint (what transformers builds as nn.Linear); the router
# (`block_sparse_moe.gate`) is not one of them, the head is ignored as llm-compressor does
LINEAR = re.compile(r"(_proj|_proj_with_mqa|\.w[123]|lm_head)\.weight$")
IGNORE = ["lm_head", "re:.*self_attn\\.b_proj$"]


def _ct_quantize(state: dict[str, torch.Tensor], args: QuantizationArgs
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The package's compressed checkpoint of `state`, and the package's dequantized
    weights (its decompress) of the same."""
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out, deq = {}, {}
    for name, w in state.items():
        module = name[: -len(".weight")]
        if not LINEAR.search(name) or module == "lm_head" or module.endswith(".b_proj"):
            out[name] = deq[name] = w
            continue
        n, k = w.shape
        g = args.group_size
        groups = w.float().reshape(n, k // g, g)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        local = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zp}
        packed = PackedQuantizationCompressor.compress(local, scheme)
        out.update({f"{module}.{key}": t for key, t in packed.items()})
        # the package's dequantize of its own unpacked integers (its decompress also unpacks
        # the zero points, which fails on this torch for layers of <= 32/bits rows: a
        # [1, G] int32 tensor transposed cannot be viewed as bytes)
        q = unpack_from_int32(packed["weight_packed"], args.num_bits, packed["weight_shape"])
        deq[name] = dequantize(q, scale, None if args.symmetric else zp, args).float()
    return out, deq


@pytest.fixture(params=[(4, True), (8, True), (4, False)], ids=["int4", "int8", "int4-asym"])
def ct_checkpoint(request, tmp_path):
    bits, symmetric = request.param
    cfg = tiny_config(**CFG)
    save_model(random_model(cfg), tmp_path / "float")
    state = load_file(str(tmp_path / "float" / "model.safetensors"))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group",
                            group_size=8)
    packed, deq = _ct_quantize(state, args)
    raw = json.loads((tmp_path / "float" / "config.json").read_text())
    for name, files in (("quant", packed), ("oracle", deq)):
        (tmp_path / name).mkdir()
        save_file(files, str(tmp_path / name / "model.safetensors"))
        conf = dict(raw)
        if name == "quant":
            qc = QuantizationConfig(
                config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                format="pack-quantized", quantization_status="compressed", ignore=IGNORE)
            conf["quantization_config"] = qc.model_dump(mode="json")
        (tmp_path / name / "config.json").write_text(json.dumps(conf))
    return tmp_path, bits


def test_compressed_tensors_checkpoint_loads(ct_checkpoint) -> None:
    path, bits = ct_checkpoint
    q = load_model(path / "quant", progress=False)
    ref = load_model(path / "oracle", progress=False)
    assert q.config.weight_quant.bits == bits
    attn = q.model.layers[0].self_attn
    assert isinstance(attn.q_proj, QuantLinear) and type(attn.b_proj) is torch.nn.Linear
    assert type(q.lm_head) is torch.nn.Linear                     # ignored
    assert q.model.layers[1].block_sparse_moe.int_quant is not None
    ids = torch.randint(0, q.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = q.forward_dense(ids), ref.forward_dense(ids)
    # the same weights to fp32 rounding (the package's dequantize computes in its own order)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compressed_tensors_greedy_tokens_match(ct_checkpoint) -> None:
    from kdaserve import LLM, SamplingParams

    path, _ = ct_checkpoint
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": [7, 3, 19, 30, 2, 8]}, {"prompt_token_ids": [44, 1]}]
    outs = [[o.outputs[0].token_ids for o in
             LLM(str(path / name), max_num_seqs=4, cache_memory=16 << 20,
                 num_threads=1).generate(prompts, sp, use_tqdm=False)]
            for name in ("quant", "oracle")]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("scheme,extra", [("int4", []), ("int8", ["--asymmetric"])])
def test_kdaserve_quantize_is_read_by_compressed_tensors(tmp_path, scheme, extra) -> None:
    """`kdaserve quantize` writes what the package decompresses to kdaserve's own weights."""
    cfg = tiny_config(**CFG)
    save_model(random_model(cfg), tmp_path / "float")
    subprocess.run([sys.executable, "-m", "kdaserve.cli", "quantize", str(tmp_path / "float"),
                    str(tmp_path / "q"), "--scheme", scheme, "--group-size", "16", *extra],
                   check=True, capture_output=True)
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(raw["quantization_config"])
    scheme_ = qc.config_groups["group_0"]
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    ours = load_model(tmp_path / "q", progress=False)
    # MLA's o_proj reads 24 columns: no whole groups of 16, so it stays float and ignored
    assert "model.layers.2.self_attn.o_proj" in qc.ignore
    assert type(ours.model.layers[2].self_attn.o_proj) is torch.nn.Linear
    layers = {"model.layers.0.self_attn.q_proj": ours.model.layers[0].self_attn.q_proj,
              "lm_head": ours.lm_head}
    for module, layer in layers.items():
        local = {k.rsplit(".", 1)[1]: v for k, v in state.items()
                 if k.rsplit(".", 1)[0] == module}
        back = PackedQuantizationCompressor.decompress(local, scheme_)["weight"]
        torch.testing.assert_close(back.float(), layer.dequantized(), rtol=0, atol=1e-6)
    moe = ours.model.layers[1].block_sparse_moe
    prefix = "model.layers.1.block_sparse_moe.experts.5.w2"
    local = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == prefix}
    back = PackedQuantizationCompressor.decompress(local, scheme_)["weight"]
    torch.testing.assert_close(back.float(), moe._expert(5, torch.float32)[1], rtol=0,
                               atol=1e-6)


def test_kdaserve_quantize_of_bf16_writes_what_fp32_then_quantize_wrote(tmp_path) -> None:
    """`kdaserve quantize` now quantizes as it loads (a bf16 checkpoint is never all fp32):
    the same tensors as loading in fp32, quantizing and saving; a quantized IN is refused
    with a clear message, not a traceback."""
    from kdaserve.model.quantize import quantize_model
    from kdaserve.quant_config import WeightQuant

    cfg = tiny_config(**CFG)
    save_model(random_model(cfg), tmp_path / "bf16", dtype=torch.bfloat16)
    subprocess.run([sys.executable, "-m", "kdaserve.cli", "quantize", str(tmp_path / "bf16"),
                    str(tmp_path / "q"), "--scheme", "int4", "--group-size", "16"],
                   check=True, capture_output=True)
    old = quantize_model(load_model(tmp_path / "bf16", progress=False),
                         WeightQuant(4, 16), whole_groups=True)
    save_model(old, tmp_path / "old", dtype=torch.bfloat16)
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("q", "old"))
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    again = subprocess.run([sys.executable, "-m", "kdaserve.cli", "quantize",
                            str(tmp_path / "q"), str(tmp_path / "qq"), "--scheme", "int8"],
                           capture_output=True, text=True)
    assert again.returncode != 0
    assert "already quantized" in again.stderr and "Traceback" not in again.stderr
