// Search results name their page: "When a worker dies › Which errors are retried", not the
// section's title alone. The theme's search script formats each result with formatResult();
// once the page has loaded (after that script), this one takes its place. Page titles come
// from the navigation bar's links, so nothing is fetched: it works from a local copy too.
window.addEventListener("DOMContentLoaded", function () {
  if (typeof formatResult !== "function") {
    return;
  }
  var titles = {};
  document.querySelectorAll(".navbar a.dropdown-item, .navbar a.nav-link").forEach(function (link) {
    var path = new URL(link.href, document.baseURI).pathname;
    titles[path] = link.textContent.trim();
  });
  var escape = function (text) {
    var span = document.createElement("span");
    span.textContent = text;
    return span.innerHTML;
  };
  window.formatResult = function (location, title, summary) {
    var url = joinUrl(base_url, location);
    var page = titles[new URL(url, document.baseURI).pathname] || "";
    var heading = page && page !== title ? page + " \u203a " + title : title;
    return '<article><h3><a href="' + url + '">' + escape(heading) + "</a></h3><p>" + escape(summary) + "</p></article>";
  };
});
