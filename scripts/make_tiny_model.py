"""Write a tiny random-weight HF checkpoint (real BPE tokenizer, fp32 safetensors) for tests and demos.

python scripts/make_tiny_model.py build/tiny-llama
python scripts/make_tiny_model.py build/tiny-qwen2 --arch qwen2 --seed 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.sources.tiny import ARCHITECTURES, INIT_STD, make_tiny_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed -> identical files")
    parser.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary size")
    parser.add_argument("--init-std", type=float, default=INIT_STD, help="std of the random weights")
    args = parser.parse_args(argv)
    facts = make_tiny_checkpoint(
        args.out_dir, arch=args.arch, seed=args.seed, vocab_size=args.vocab_size, init_std=args.init_std
    )
    print(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
