from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers"

    def ready(self):
        from workers import receivers  # noqa: F401  (connects the round_closed receiver)
