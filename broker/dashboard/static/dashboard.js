// Live refresh: every few seconds, fetch this page again and swap in the regions marked
// data-live (tables, states, buttons). Forms the user types into sit outside them, so
// nothing typed is lost; a region holding the focus, or ticked rows, is left alone until
// it loses it (or they are cleared).
// Row selection: the list's checkboxes are a plain form (it works without this); this
// only adds "select every job on this page", and keeps a refresh from clearing a selection.
(function () {
  "use strict";
  var all = document.getElementById("select-all");
  if (!all) { return; }
  all.parentNode.hidden = false;
  function rows() { return document.querySelectorAll("#jobs-table input.select-row"); }
  all.addEventListener("change", function () {
    rows().forEach(function (box) { box.checked = all.checked; });
  });
  document.addEventListener("change", function (event) {
    if (!event.target.classList || !event.target.classList.contains("select-row")) { return; }
    var boxes = Array.prototype.slice.call(rows());
    all.checked = boxes.length > 0 && boxes.every(function (box) { return box.checked; });
  });
})();

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
        // a region holding the focus, or rows ticked for an action, is left as it is
        if (!next || region.contains(document.activeElement) ||
            region.querySelector("input.select-row:checked")) { return; }
        if (next.innerHTML !== region.innerHTML) { region.innerHTML = next.innerHTML; }
      });
      mark(true);
    }).catch(function () { mark(false); }).then(schedule);
  }

  function schedule() { window.setTimeout(refresh, period); }
  schedule();
})();
