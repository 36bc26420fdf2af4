// A form with data-confirm="..." asks before it is sent (the revoke, reset-password,
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
