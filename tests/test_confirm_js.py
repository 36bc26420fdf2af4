"""static/dashboard/confirm.js, run by Node against a minimal stand-in of the DOM it uses (the
browser tests need Chromium; this logic needs only the events): a form that asks first, and a
form's second submission (a double click) that is not sent."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "static" / "dashboard" / "confirm.js"

HARNESS = r"""
const fs = require("fs");
const vm = require("vm");
const listeners = {};
const on = (table) => (type, fn) => { (table[type] = table[type] || []).push(fn); };
const windowListeners = {};
const answers = JSON.parse(process.argv[2]);
let asked = 0;
const created = [];
const sandbox = {
  document: {
    addEventListener: on(listeners), referrer: "",
    // only the selector confirm.js asks: form[ATTRIBUTE]
    querySelectorAll: (selector) => {
      const attribute = /^form\[([\w-]+)\]$/.exec(selector)[1];
      return created.filter((f) => f.hasAttribute(attribute));
    },
  },
  window: { addEventListener: on(windowListeners), history: { length: 1 },
            location: { origin: "http://testserver" },
            confirm: () => answers[asked++] },
};
sandbox.window.document = sandbox.document;
vm.runInNewContext(fs.readFileSync(process.argv[1], "utf8"), sandbox);
function form(method, confirm) {
  const attrs = { method: method };
  if (confirm) attrs["data-confirm"] = confirm;
  const made = { getAttribute: (k) => (k in attrs ? attrs[k] : null),
                 setAttribute: (k, v) => { attrs[k] = String(v); },
                 removeAttribute: (k) => { delete attrs[k]; },
                 hasAttribute: (k) => k in attrs };
  created.push(made);
  return made;
}
function submit(target) {
  const event = { type: "submit", target: target, defaultPrevented: false,
                  preventDefault() { this.defaultPrevented = true; } };
  (listeners.submit || []).forEach((fn) => fn(event));
  return !event.defaultPrevented;  // sent
}
const forms = { post: form("post"), get: form("get"),
                confirmed: form("post", "Revoke it?") };
const sent = {
  post: [submit(forms.post), submit(forms.post)],
  get: [submit(forms.get), submit(forms.get)],
  // dismissed first (nothing sent, nothing held back), then confirmed, then a second click
  confirmed: [submit(forms.confirmed), submit(forms.confirmed), submit(forms.confirmed)],
};
// Back to the page from the browser's cache: its forms may be sent again.
(windowListeners.pageshow || []).forEach((fn) => fn({ persisted: true }));
sent.after_back = [submit(forms.post), submit(forms.post)];
process.stdout.write(JSON.stringify({ sent: sent, asked: asked }));
"""


def run_confirm_js(answers: list[bool]) -> dict:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("Node.js is not installed")
    result = subprocess.run(
        [node, "-e", HARNESS, "--", str(SCRIPT), json.dumps(answers)],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_post_form_is_sent_once_however_often_its_button_is_pressed():
    """A double click on Approve (or Add, Enroll) sent the form twice: the second request was
    refused (the client already approved, the login already there) and its refusal page replaced
    the first answer, the only page that showed the new token or password."""
    outcome = run_confirm_js([False, True])
    assert outcome["sent"]["post"] == [True, False]
    assert outcome["sent"]["get"] == [True, True]  # a filter form may be sent again
    # a dismissed question sends nothing and does not hold back the confirmed submission
    assert outcome["sent"]["confirmed"] == [False, True, False]
    assert outcome["asked"] == 2  # the second click of a confirmed form asks nothing
    # a page brought back from the browser's cache (Back) sends its forms again
    assert outcome["sent"]["after_back"] == [True, False]
