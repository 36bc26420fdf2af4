from django.apps import AppConfig


class SynapseWebConfig(AppConfig):
    name = "synapse_web"
    verbose_name = "SYNAPSE"

    def ready(self):
        from synapse_web import dbcheck

        dbcheck.connect()
