"""Sphinx's configuration of the course's site (given). `course/site/build.py` runs Sphinx on a staged copy
of docs/ and notebooks/ with this folder as its configuration folder: read that file first.

Everything a page loads is served from the built folder itself (the site works offline, from file://):
the theme's own files, and KaTeX (vendored in static/katex/, see its README.md) for the maths.
"""
from sphinx.ext.mathjax import html_visit_displaymath, html_visit_math

project = "Distributed LLM training, built by hand"
author = "the course"
copyright = "the course's authors"

extensions = ["myst_nb"]
# Notebooks arrive executed (build.py stages executed copies); Sphinx never runs them itself.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]  # chapters start a section at ### under a ## now and then

html_theme = "sphinx_book_theme"
html_title = "Distributed LLM training, built by hand"
html_math_renderer = "katex"  # registered in setup() below
html_static_path = ["static"]  # build.py adds the folder of what it generates (the explorer's data)
html_css_files = ["site.css"]
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None
html_context = {"default_mode": "auto"}  # the theme's default is none, which it reports as an error
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "show_navbar_depth": 1,
}


def setup(app):
    """KaTeX as Sphinx's maths renderer: the HTML is the one Sphinx writes for MathJax (\\( \\) and \\[ \\]
    around the TeX), typeset in the browser by KaTeX's auto-render, on the pages that have maths only."""
    app.add_html_math_renderer("katex", inline_renderers=(html_visit_math, None),
                               block_renderers=(html_visit_displaymath, None))
    app.connect("html-page-context", add_katex)


def add_katex(app, pagename, templatename, context, doctree):
    has_maths = context["has_maths_elements"] if "has_maths_elements" in context else (  # Sphinx >= 8.2
        doctree is not None and app.env.get_domain("math").has_equations(pagename))
    if has_maths:
        app.builder.add_css_file("katex/katex.min.css")
        for script in ("katex/katex.min.js", "katex/auto-render.min.js", "katex-typeset.js"):
            app.builder.add_js_file(script, defer="defer")
