from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerSplitView

from federation.api.metrics import MetricsView
from federation.auth import LoginForm
from federation.dashboard.views import LogoutView, PasswordChangeView
from synapse_web.health import readiness
from synapse_web.openapi import SchemaView


def health(request):
    """Readiness: 200 when the database answers with every migration applied, 503 naming the
    failure otherwise (for a load balancer or compose healthcheck; no login, nothing private)."""
    status, body = readiness()
    return JsonResponse(body, status=status)


# A 500 or 400 under /api/ is JSON {"detail": ...} (its 404s: synapse_web.middleware's
# ApiJsonNotFoundMiddleware, since DEBUG's 404 page does not go through handler404).
handler500 = "synapse_web.middleware.server_error"
handler400 = "synapse_web.middleware.bad_request"

urlpatterns = [
    # The admin's own password change is the dashboard's (audited, throttled).
    path("admin/password_change/", PasswordChangeView.as_view()),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(authentication_form=LoginForm), name="login"),
    path("accounts/logout/", LogoutView.as_view(), name="logout"),
    path(
        "accounts/password_change/", PasswordChangeView.as_view(), name="password_change"
    ),
    path("healthz", health, name="health"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("api/v1/", include("federation.api.urls")),
    # The browsable API's login (rest_framework.urls' view, with the form that says when the
    # sign-in throttle refused); its logout and URL names from the include below.
    path(
        "api-auth/login/",
        auth_views.LoginView.as_view(
            template_name="rest_framework/login.html", authentication_form=LoginForm
        ),
    ),
    path("api-auth/logout/", LogoutView.as_view()),  # a GET asks, as /accounts/logout/ does
    path("api-auth/", include("rest_framework.urls")),  # login for the browsable API
    path("api/v1/", include("routing.urls")),
    path("api/schema/", SchemaView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
    path("", include("federation.dashboard.urls")),
]
