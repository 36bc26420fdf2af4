"""Sign-in for people: the authentication backend that enforces the sign-in throttle
(`federation.login_throttle`) and the login forms that say when it refused."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm, PasswordChangeForm
from django.core.exceptions import PermissionDenied, ValidationError

from federation import login_throttle
from federation.services import Actor, client_ip


class ThrottledModelBackend(ModelBackend):
    """Django's username and password backend, refusing (PermissionDenied: no other backend is
    tried) a username or address locked by too many failed sign-ins before it looks at the
    password. Each attempt is counted as a failure before the password is checked and uncounted
    when it was right (`login_throttle.begin_attempt`): guesses sent in parallel cannot all pass
    the check. A refused attempt counts nothing: it does not extend the lock."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if username is None or password is None:
            return None
        attempt = login_throttle.begin_attempt(username, client_ip(request))
        if attempt.lock is not None:
            login_throttle.end_attempt(attempt, succeeded=False)
            raise PermissionDenied("too many failed sign-ins")
        user = None
        try:
            user = super().authenticate(request, username=username, password=password)
        finally:
            login_throttle.end_attempt(attempt, succeeded=user is not None)
        return user

    async def aauthenticate(self, request, username=None, password=None, **kwargs):
        return await sync_to_async(self.authenticate)(request, username, password, **kwargs)


class ThrottleAwareLoginMixin:
    """A refused sign-in says it was the throttle ("Too many failed sign-ins for this account;
    try again in N minutes"), not that the password was wrong."""

    throttle_message = ""

    def get_invalid_login_error(self):
        lock = login_throttle.lock_for(self.cleaned_data.get("username"), client_ip(self.request))
        if lock is None:
            return super().get_invalid_login_error()
        self.throttle_message = lock.message
        return ValidationError(lock.message, code="throttled")


class LoginForm(ThrottleAwareLoginMixin, AuthenticationForm):
    pass


class AdminLoginForm(ThrottleAwareLoginMixin, AdminAuthenticationForm):
    pass


class ThrottledPasswordChangeForm(PasswordChangeForm):
    """Changing one's password asks for the current one: a wrong guess counts as a failed
    sign-in of that username and address, and a locked username or address is refused before
    the password is checked (a stolen session must not guess the password without limit)."""

    def __init__(self, user, *args, request=None, **kwargs):
        super().__init__(user, *args, **kwargs)
        self.request = request

    def clean_old_password(self):
        username = self.user.get_username()
        ip = client_ip(self.request) if self.request is not None else None
        # A lock this brings is audited as the signed-in person's (a borrowed session guessing),
        # not as an anonymous sign-in.
        attempt = login_throttle.begin_attempt(username, ip, actor=Actor.for_user(self.user, ip))
        lock = attempt.lock
        if lock is not None:
            login_throttle.end_attempt(attempt, succeeded=False)
            raise ValidationError(lock.message, code="throttled")
        succeeded = False
        try:
            old = super().clean_old_password()
            succeeded = True
            return old
        finally:
            login_throttle.end_attempt(attempt, succeeded)
