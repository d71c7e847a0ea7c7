// Live refresh: every few seconds, fetch this page again and swap in the regions marked
// data-live (tables, states, buttons). Forms the user types into sit outside them, so
// nothing typed is lost; a region holding the focus is left alone until it loses it.
(function () {
  "use strict";
  var period = parseInt(document.body.getAttribute("data-refresh-ms"), 10) || 3000;
  var status = document.getElementById("live-status");
  if (!document.querySelector("[data-live]")) { return; }

  function mark(ok) {
    if (!status) { return; }
    status.textContent = ok ? "live · " + new Date().toLocaleTimeString() : "live · offline";
    status.className = ok ? "" : "stale";
  }

  function refresh() {
    if (document.hidden) { return schedule(); }
    fetch(window.location.href, {
      headers: { "X-Live-Refresh": "1" }, credentials: "same-origin", cache: "no-store"
    }).then(function (response) {
      if (!response.ok) { throw new Error(response.status); }
      return response.text();
    }).then(function (html) {
      var fresh = new DOMParser().parseFromString(html, "text/html");
      document.querySelectorAll("[data-live]").forEach(function (region) {
        var next = fresh.getElementById(region.id);
        if (!next || region.contains(document.activeElement)) { return; }
        if (next.innerHTML !== region.innerHTML) { region.innerHTML = next.innerHTML; }
      });
      mark(true);
    }).catch(function () { mark(false); }).then(schedule);
  }

  function schedule() { window.setTimeout(refresh, period); }
  schedule();
})();
