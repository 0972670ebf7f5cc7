"""Markdown tables for the benchmark scripts (imported as `tables` when a script runs from
this folder)."""


def print_markdown(headers, rows, numeric_from: int = 1):
    """Print a Markdown table: `headers` (strings), `rows` (lists of already formatted
    cells); columns from `numeric_from` on are right-aligned."""
    print("| " + " | ".join(headers) + " |")
    print("| " + " | ".join("---" if i < numeric_from else "---:" for i in range(len(headers))) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
