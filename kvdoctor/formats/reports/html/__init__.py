"""HTML: one self-contained page (inline CSS and SVG, no scripts, no fonts, nothing fetched).

`page` lays the report out; `svg` draws its plots; `text` is how it writes quantities.
"""

from kvdoctor.formats.reports.html.page import finding_card, render_html

__all__ = ["finding_card", "render_html"]
