from django.urls import path

from routing.api import RouteBatchView, RouteView

urlpatterns = [
    path("route/", RouteView.as_view(), name="route"),
    path("route/batch/", RouteBatchView.as_view(), name="route-batch"),
]
