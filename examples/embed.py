"""Embedding LQL in a Python tool: open a container, run statements, use typed results.

    python examples/embed.py [path/to/model.vindex3]

Without an argument it opens the built-in default model."""

from __future__ import annotations

import sys

import lql


def main(argv: list[str]) -> int:
    try:
        s = lql.connect(argv[0]) if argv else lql.Session()
        if not argv:
            s.execute("OPEN DEFAULT")
        stats, infer = s.execute("STATS; INFER 'The capital of France is' TOP 3;")
    except lql.LqlError as e:  # a refusal or a syntax error: its message names the problem
        print(f"error: {e}", file=sys.stderr)
        return 1

    # Results are pydantic models: fields for code, to_text() for people, model_dump() for JSON.
    print(f"{stats.name}: {stats.layers} layers, {stats.parameters:,} parameters")
    for c in infer.top:
        print(f"  {c.rank}. {c.token!r} (id {c.id}) p={c.probability:.4f}")
    print(infer.to_text(timing=False))

    # Refusals are typed and positioned at their statement.
    try:
        s.execute("SHOW LAYERS;\nDRAFT DEPTH 1000;")
    except lql.LqlError as e:
        print(f"refused at line {e.line}: {e.message}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
