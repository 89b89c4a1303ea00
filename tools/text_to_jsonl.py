#!/usr/bin/env python3
"""Converts plain text to jsonl for `dtk preprocess`, one document per paragraph.

`dtk preprocess` treats a plain-text file as ONE document. To get many documents (so that a
train/valid/test split of documents has something in every split), write one JSON line per
blank-line-separated paragraph:

    python3 tools/text_to_jsonl.py tests/data/fixtures/shakespeare_excerpt.txt data/shakespeare.jsonl
"""
import json
import re
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as f:
        text = f.read()
    n = 0
    with open(sys.argv[2], "w", encoding="utf-8") as out:
        for para in re.split(r"\n\s*\n", text):
            if para.strip():
                out.write(json.dumps({"text": para.strip("\n") + "\n"}, ensure_ascii=False) + "\n")
                n += 1
    print(f"text_to_jsonl: {n} documents -> {sys.argv[2]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
