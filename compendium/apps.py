from django.apps import AppConfig


class CompendiumConfig(AppConfig):
    name = "compendium"
    verbose_name = "Compendium"
