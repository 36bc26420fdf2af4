"""Dashboard URLs. A page adds its pattern here and registers its navigation item beside it."""

from django.urls import path

from federation.dashboard import nav, views

app_name = "dashboard"

urlpatterns = [
    path("", views.OverviewView.as_view(), name="overview"),
    path("rounds/open/", views.RoundActionView.as_view(), {"action": "open"}, name="round-open"),
    path("rounds/<int:number>/<str:action>/", views.RoundActionView.as_view(), name="round-action"),
    path("organizations/", views.OrganizationListView.as_view(), name="organizations"),
    path("organizations/<slug:slug>/", views.OrganizationView.as_view(), name="organization"),
    path(
        "organizations/<slug:slug>/rename/",
        views.OrganizationRenameView.as_view(),
        name="organization-rename",
    ),
    path(
        "organizations/<slug:slug>/people/add/",
        views.PersonActionView.as_view(),
        {"action": "add"},
        name="person-add",
    ),
    path(
        "organizations/<slug:slug>/people/<int:user_id>/<str:action>/",
        views.PersonActionView.as_view(),
        name="person-action",
    ),
    path(
        "organizations/<slug:slug>/enroll/",
        views.OrganizationActionView.as_view(),
        {"action": "enroll"},
        name="client-enroll",
    ),
    path(
        "organizations/<slug:slug>/clients/<int:client_id>/<str:action>/",
        views.OrganizationActionView.as_view(),
        name="client-action",
    ),
    path("conflicts/", views.ConflictsView.as_view(), name="conflicts"),
    path("conflicts/<int:pk>/decide/", views.ConflictDecideView.as_view(), name="conflict-decide"),
    path("privacy/", views.PrivacyView.as_view(), name="privacy"),
    path("accuracy/", views.AccuracyView.as_view(), name="accuracy"),
    path("compendium/", views.CompendiumView.as_view(), name="compendium"),
    path("tools/", views.ToolRegistryView.as_view(), name="tools"),
    path("routing/", views.RoutingView.as_view(), name="routing"),
    path("audit/", views.AuditView.as_view(), name="audit"),
    path("settings/", views.SettingsView.as_view(), name="settings"),
    path("account/tokens/", views.TokensView.as_view(), name="tokens"),
]

nav.register("overview", "Overview", "dashboard:overview")
nav.register("organizations", "Organizations", "dashboard:organizations")
nav.register("conflicts", "Conflicts", "dashboard:conflicts")
nav.register("privacy", "Privacy", "dashboard:privacy")
nav.register("accuracy", "Accuracy", "dashboard:accuracy")
nav.register("compendium", "Compendium", "dashboard:compendium")
nav.register("tools", "Tool registry", "dashboard:tools")
nav.register("routing", "Routing", "dashboard:routing")
nav.register("audit", "Audit log", "dashboard:audit")
nav.register("settings", "Settings", "dashboard:settings")
