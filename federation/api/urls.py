from django.urls import path

from federation.api import views

app_name = "api"

urlpatterns = [
    path("submissions/", views.SubmissionView.as_view(), name="submissions"),
    path("rounds/", views.RoundListView.as_view(), name="rounds"),
    path("rounds/<int:pk>/", views.RoundDetailView.as_view(), name="round-detail"),
    path("compendium/schema/", views.SchemaView.as_view(), name="compendium-schema"),
    path("compendium/probe/", views.ProbeSetView.as_view(), name="compendium-probe"),
    path("compendium/global/", views.GlobalCompendiumView.as_view(), name="compendium-global"),
    path("compendium/global/head/", views.GlobalRoutingHeadView.as_view(), name="compendium-head"),
    path("compendium/global/router/", views.GlobalRouterView.as_view(), name="compendium-router"),
    path(
        "compendium/global/router/files/<path:name>",
        views.GlobalRouterFileView.as_view(),
        name="compendium-router-file",
    ),
    path("admin/organizations/", views.OrganizationListView.as_view(), name="organizations"),
    path(
        "admin/organizations/<int:pk>/",
        views.OrganizationDetailView.as_view(),
        name="organization-detail",
    ),
    path("admin/clients/", views.ClientListView.as_view(), name="clients"),
    path("admin/clients/<int:pk>/", views.ClientDetailView.as_view(), name="client-detail"),
    path("admin/clients/<int:pk>/approve/", views.ClientApproveView.as_view(), name="client-approve"),
    path("admin/clients/<int:pk>/rotate/", views.ClientRotateView.as_view(), name="client-rotate"),
    path("admin/clients/<int:pk>/revoke/", views.ClientRevokeView.as_view(), name="client-revoke"),
    path("admin/people/", views.PersonListView.as_view(), name="people"),
    path("admin/people/<int:pk>/", views.PersonDetailView.as_view(), name="person-detail"),
    path(
        "admin/people/<int:pk>/reset-password/",
        views.PersonResetPasswordView.as_view(),
        name="person-reset-password",
    ),
    path("admin/audit/", views.AuditLogView.as_view(), name="audit"),
    path("admin/rounds/", views.RoundOpenView.as_view(), name="round-open"),
    path("admin/rounds/<int:pk>/close/", views.RoundCloseView.as_view(), name="round-close"),
    path("admin/rounds/<int:pk>/deadline/", views.RoundDeadlineView.as_view(), name="round-deadline"),
    path("admin/rounds/<int:pk>/retry/", views.RoundRetryView.as_view(), name="round-retry"),
    path("admin/rounds/<int:pk>/fail/", views.RoundFailView.as_view(), name="round-fail"),
    path("admin/settings/", views.SettingsView.as_view(), name="settings"),
]
