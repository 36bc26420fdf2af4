"""Dashboard URLs. A page adds its pattern here and registers its navigation item beside it."""

from django.urls import path

from federation.dashboard import nav, views

app_name = "dashboard"

urlpatterns = [
    path("", views.OverviewView.as_view(), name="overview"),
    path("compendium/", views.CompendiumView.as_view(), name="compendium"),
    path("tools/", views.ToolRegistryView.as_view(), name="tools"),
]

nav.register("overview", "Overview", "dashboard:overview")
nav.register("compendium", "Compendium", "dashboard:compendium")
nav.register("tools", "Tool registry", "dashboard:tools")
