"""A check of the built site's HTML, without a browser (given): run by tests/test_course_site.py and by the
browser check before it starts Chromium.

On every page: no asset from outside the site (a script, stylesheet, icon, image, frame or media source, or
a url() in a page's or a stylesheet's CSS, that names a host or a scheme other than data:), every asset
there, and every link into the site resolving: the file, and the #anchor on it if there is one. Links out
of the site (to ui.perfetto.dev, say) are allowed: nothing loads them.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ASSET_ATTRIBUTES = {"script": "src", "img": "src", "iframe": "src", "source": "src", "video": "src",
                    "audio": "src", "embed": "src", "object": "data", "input": "src"}
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+?)['\"]?\s*\)")


class Page(HTMLParser):
    """The assets, links and ids of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.assets, self.links, self.ids, self.css = [], [], set(), []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag in ASSET_ATTRIBUTES and attrs.get(ASSET_ATTRIBUTES[tag]):
            self.assets.append(attrs[ASSET_ATTRIBUTES[tag]])
        if tag == "img" and attrs.get("srcset"):
            self.assets += [part.split()[0] for part in attrs["srcset"].split(",") if part.strip()]
        if tag == "link" and attrs.get("href"):
            rels = set((attrs.get("rel") or "").lower().split())
            (self.assets if rels & {"stylesheet", "icon", "preload", "modulepreload", "manifest"} else self.links
             ).append(attrs["href"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if attrs.get("style"):
            self.css.append(attrs["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.css.append(data)


def parse(page: Path) -> Page:
    parser = Page()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def is_external(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.netloc) or parts.scheme not in ("", "data")


def is_link_out(url: str) -> bool:
    """A link that leaves the site on purpose: another host, an e-mail address, a script."""
    return bool(urlsplit(url).netloc) or urlsplit(url).scheme in ("http", "https", "mailto", "javascript")


def target(page: Path, url: str) -> Path:
    path = unquote(urlsplit(url).path)
    return page if not path else (page.parent / path).resolve()


def css_problems(where: str, css: str, base: Path) -> list[str]:
    problems = []
    for url in CSS_URL.findall(css):
        if is_external(url):
            problems.append(f"{where}: loads {url} from outside the site (CSS url())")
        elif not url.startswith("data:") and not target(base, url).exists():
            problems.append(f"{where}: CSS url({url}) names no file")
    return problems


def check_site(site: Path) -> list[str]:
    """Every problem found in the site built in `site`, one line each (none: the site is sound)."""
    pages = {path.resolve(): parse(path) for path in sorted(site.rglob("*.html"))
             if not path.relative_to(site).parts[0].startswith("_")}  # _static/ holds the theme's templates
    problems, stylesheets = [], set()
    for path, page in pages.items():
        where = str(path.relative_to(site.resolve()))
        for url in page.assets:
            if is_external(url):
                problems.append(f"{where}: loads {url} from outside the site")
            elif not target(path, url).is_file():
                problems.append(f"{where}: loads {url}, which is not in the site")
            elif urlsplit(url).path.endswith(".css"):
                stylesheets.add(target(path, url))
        for css in page.css:
            problems += css_problems(where, css, path)
        for url in page.links:
            if is_link_out(url):
                continue
            file, anchor = target(path, url), unquote(urlsplit(url).fragment)
            if not file.exists():
                problems.append(f"{where}: links to {url}, which is not in the site")
            elif anchor and file.suffix == ".html" and file.is_file() and file in pages and anchor not in pages[file].ids:
                problems.append(f"{where}: links to {url}, but that page has no #{anchor}")
    for sheet in sorted(stylesheets):
        problems += css_problems(str(sheet.relative_to(site.resolve())), sheet.read_text(encoding="utf-8"), sheet)
    return problems
