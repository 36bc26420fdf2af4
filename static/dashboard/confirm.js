// A form with data-confirm="..." asks before it is sent (the revoke, rotate, reset-password,
// deactivate and round close buttons). A file rather than an onsubmit attribute: the Content-Security-Policy
// allows no inline script.
// A POST form is sent once: a second press of its button (a double click) before the answer
// arrives is ignored. Sent twice, the second request was refused (a client approved already, a
// login added already) and its refusal page replaced the first answer, the only page that showed
// the new token or password. A page brought back from the browser's cache (Back) sends again.
(function () {
  "use strict";
  var SENT = "data-sent";
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form.getAttribute) {
      return;
    }
    var post = (form.getAttribute("method") || "").toLowerCase() === "post";
    if (post && form.getAttribute(SENT) !== null) {
      event.preventDefault();
      return;
    }
    var message = form.getAttribute("data-confirm");
    if (message && !window.confirm(message)) {
      event.preventDefault();
      return;
    }
    if (post && !event.defaultPrevented) {
      form.setAttribute(SENT, "");
    }
  });
  window.addEventListener("pageshow", function (event) {
    if (!event.persisted || !document.querySelectorAll) {
      return;
    }
    document.querySelectorAll("form[" + SENT + "]").forEach(function (form) {
      form.removeAttribute(SENT);
    });
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

// A page sent in answer to a POST that shows a token or password once (<body data-address>, the
// page's own address) takes that address in the browser's history in place of the form's action.
// Otherwise Back from a refusal of a form sent from it led to Chromium's "Confirm Form
// Resubmission" error (the answer is kept from the cache), and a reload sent the approval,
// rotation or reset again. Now both load the page itself, without the token.
(function () {
  "use strict";
  var address = document.body && document.body.getAttribute("data-address");
  if (address && window.history.replaceState) {
    window.history.replaceState(null, "", address + window.location.hash);
  }
})();
