"""Heavy imports stay where they are used: the CLI's parser without torch (fast --help), a
worker without the server or the grammar compiler. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _loaded(code: str, prefixes: tuple[str, ...]) -> list[str]:
    probe = (f"{code}\nimport sys\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {prefixes!r} "
             f"or m.startswith({prefixes!r})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120, check=True).stdout
    return eval(out.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [[], ["serve"], ["generate", "hi"]])
def test_cli_parser_does_not_import_torch(argv):
    code = ("from kdaserve.cli import build_parser\n"
            f"p = build_parser()\nargv = {argv!r}\n"
            "if argv: p.parse_args(argv)\n")
    assert _loaded(code, ("torch", "transformers", "llguidance", "fastapi")) == []


def test_worker_does_not_import_server_or_grammar_compiler():
    code = "import kdaserve.engine.executor.worker, kdaserve.engine.executor.multiproc"
    assert _loaded(code, ("kdaserve.server", "llguidance", "fastapi", "uvicorn")) == []


def test_cuda_bench_does_not_import_the_server():
    # the GPU machines have no FastAPI/uvicorn; the sections' lazy imports are included
    code = ("import kdaserve.bench.cuda.cli, kdaserve.engine.llm, kdaserve.bench.spec, "
            "kdaserve.bench.spec_measure, kdaserve.bench.long, kdaserve.bench.spec_prompts")
    assert _loaded(code, ("kdaserve.server", "fastapi", "uvicorn")) == []


_GENERATE = """
from kdaserve import LLM, SamplingParams
from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from kdaserve.structured.spec import GuidedDecoding

llm = LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=128, cache_memory=16 << 20, max_num_seqs=4,
          num_threads=1)
guided = {guided}
sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=guided is None, guided=guided)
out = llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0]
assert out.finish_reason != "error", out
print(repr(out.text))
"""


def test_an_engine_without_grammars_does_not_import_the_grammar_compiler():
    code = _GENERATE.format(guided=None)
    assert _loaded(code, ("llguidance", "kdaserve.structured.compiler",
                          "kdaserve.structured.matcher", "kdaserve.structured.tokenizer")) == []


def test_a_guided_request_imports_it_and_is_constrained():
    code = _GENERATE.format(guided='GuidedDecoding("choice", choices=["aye", "nay"])')
    code += "assert out.text in ('aye', 'nay'), out.text\n"
    assert "llguidance" in _loaded(code, ("llguidance",))
