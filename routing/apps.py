from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self):
        from django.db.models.signals import post_delete, post_save

        from routing.services import check_routing_params_setting

        check_routing_params_setting()

        from compendium.models import CompendiumVersion, Tool
        from federation.models import Round
        from routing.models import TunedRouter
        from routing.services import forget_published_version, remove_router_folder

        # A tool (de)activated in the registry (the admin saves its row) changes what routing
        # may answer, as a new global does.
        for model in (CompendiumVersion, Round, TunedRouter, Tool):
            post_save.connect(
                forget_published_version,
                sender=model,
                dispatch_uid=f"routing-{model.__name__}-save",
            )
            post_delete.connect(
                forget_published_version,
                sender=model,
                dispatch_uid=f"routing-{model.__name__}-delete",
            )
        # A tuned router's folder goes with its row (its global deleted by an erasure or
        # re-materialized): the encoder learnt from what was erased.
        post_delete.connect(
            remove_router_folder, sender=TunedRouter, dispatch_uid="routing-tuned-router-folder"
        )
