// Typesets the maths Sphinx wrote between \( \) and \[ \] (course/site/conf.py) once the page is parsed.
// A TeX error shows in red on the page (class katex-error), which the browser check looks for.
document.addEventListener("DOMContentLoaded", () => renderMathInElement(document.body, {
  delimiters: [{left: "\\[", right: "\\]", display: true}, {left: "\\(", right: "\\)", display: false}],
  throwOnError: false,
}));
