// Auto-refresh without a reload: every data-refresh seconds, fetch this same
// address, and swap its <main id="live"> into the page (filters, focus and
// scroll stay). Countdowns tick every second in between. Same origin only:
// the content comes from this dashboard's own templates, escaped there.
(function () {
  "use strict";
  var body = document.body;
  var seconds = Math.max(1, parseInt(body.getAttribute("data-refresh"), 10) || 15);

  function short(ms) {
    var s = Math.round(Math.abs(ms) / 1000);
    var d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    var parts = [];
    if (d) parts.push(d + "d");
    if (h) parts.push(h + "h");
    if (m) parts.push(m + "m");
    if (r || !parts.length) parts.push(r + "s");
    return parts.slice(0, 2).join(" ");
  }

  function tick() {
    var now = Date.now();
    document.querySelectorAll("[data-countdown]").forEach(function (el) {
      var ms = Date.parse(el.getAttribute("data-countdown")) - now;
      el.textContent = Math.abs(ms) < 1000 ? "now" : ms > 0 ? "in " + short(ms) : short(ms) + " ago";
    });
  }

  function refresh() {
    if (document.hidden) { return schedule(); }
    fetch(window.location.href, { headers: { "Accept": "text/html" }, credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var live = fresh.getElementById("live"), stamp = fresh.getElementById("refreshed");
        if (live) { document.getElementById("live").replaceWith(document.adoptNode(live)); }
        if (stamp) { document.getElementById("refreshed").replaceWith(document.adoptNode(stamp)); }
        body.classList.remove("stale");
        tick();
      })
      .catch(function (error) {
        body.classList.add("stale");
        var stamp = document.getElementById("refreshed");
        if (stamp) { stamp.textContent = "stale: cannot read the dashboard (" + error.message + ")"; }
      })
      .then(schedule);
  }

  function schedule() { window.setTimeout(refresh, seconds * 1000); }

  tick();
  window.setInterval(tick, 1000);
  schedule();
})();
