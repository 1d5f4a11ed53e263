"""llama.cpp's convert_hf_to_gguf.py for checkpoints whose tokenizer it does not list: a
tokenizer the converter cannot identify (by the hash of how it splits a test string) is taken
as "gpt-2", the pre-tokenizer of a ByteLevel BPE with the GPT-2 split regex, as the bundled
demo's is. Usage: python convert_gguf.py LLAMA_CPP_SRC MODEL_DIR [converter options]"""

import runpy
import sys

src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]

import conversion.base as base  # noqa: E402  (from the llama.cpp source tree)

_known = base.TextModel.get_vocab_base_pre


def _pre_tokenizer(self, tokenizer) -> str:
    try:
        return _known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"


base.TextModel.get_vocab_base_pre = _pre_tokenizer
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
