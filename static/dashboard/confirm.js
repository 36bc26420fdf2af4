// A form with data-confirm="..." asks before it is sent (the revoke, rotate, reset-password,
// deactivate and round close buttons). A file rather than an onsubmit attribute: the Content-Security-Policy
// allows no inline script.
(function () {
  "use strict";
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) {
      event.preventDefault();
    }
  });
})();

// The Back link of a refusal page (templates/dashboard/bad_request.html, #back) goes back in
// the browser's history when it came from a page of this site, so that the form it refused still
// holds what was typed; loading the page again (the link's href, where there is no history)
// emptied every field.
(function () {
  "use strict";
  document.addEventListener("click", function (event) {
    var link = event.target.closest && event.target.closest("a#back");
    if (!link || window.history.length < 2 || !document.referrer) {
      return;
    }
    try {
      if (new URL(document.referrer).origin !== window.location.origin) {
        return;
      }
    } catch (e) {
      return;
    }
    event.preventDefault();
    window.history.back();
  });
})();
