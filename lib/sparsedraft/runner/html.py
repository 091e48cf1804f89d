"""HTML beside the notebooks and the markdown index, readable without Jupyter.

:func:`render_html` turns an executed notebook into one self-contained page
(figures are already inline in the notebook's outputs) with nbconvert's
``HTMLExporter``; :func:`index_html` wraps the markdown index
(``outputs/README.md``) into ``outputs/index.html`` with nbconvert's own
markdown renderer, so both indexes carry the same links and numbers.
"""

from __future__ import annotations

import html
from pathlib import Path

HTML_INDEX_FILE = "index.html"
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.45; }}
table {{ border-collapse: collapse; margin: 0.5rem 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.2rem 0.6rem; text-align: left; }}
blockquote {{ border-left: 4px solid #ddd; margin-left: 0; padding-left: 1rem; color: #333; }}
code {{ background: #f4f4f4; padding: 0 0.2rem; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""


def render_html(executed: Path) -> Path:
    """Write ``<notebook>.html`` next to the executed ``<notebook>.ipynb`` and return its path."""
    import nbformat
    from nbconvert import HTMLExporter

    notebook = nbformat.read(executed, as_version=4)
    body, _ = HTMLExporter().from_notebook_node(notebook, resources={"metadata": {"name": executed.stem}})
    target = executed.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target


def index_html(markdown: str, outputs_dir: Path, title: str = "sparsedraft results") -> Path:
    """Write ``outputs_dir/index.html`` from the markdown index text; links stay relative."""
    from nbconvert.filters import markdown2html

    path = outputs_dir / HTML_INDEX_FILE
    path.write_text(PAGE.format(title=html.escape(title), body=markdown2html(markdown)), encoding="utf-8")
    return path
