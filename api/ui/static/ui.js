// hipq dashboard: refreshes a page whose <main> has data-live="N" every N
// seconds, in place, while the tab is visible. hipq's own code, under
// hipq's terms; no third-party code. Without it the page still works.
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  if (!main || !window.fetch || !window.DOMParser) {
    return;
  }
  var every = Math.max(parseInt(main.getAttribute("data-live"), 10) || 5, 2) * 1000;
  function refresh() {
    if (document.hidden) {
      return;
    }
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok && !r.redirected ? r.text() : null; })
      .then(function (html) {
        if (!html) {
          return;
        }
        var next = new DOMParser().parseFromString(html, "text/html").querySelector("main[data-live]");
        if (next) {
          main.innerHTML = next.innerHTML;
          main.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { /* the next tick tries again */ });
  }
  window.setInterval(refresh, every);
})();
