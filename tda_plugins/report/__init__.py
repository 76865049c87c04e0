"""Human-readable reports of attribution scores."""

from tda_plugins.report.html import render_html, write_html

__all__ = ["render_html", "write_html"]
