from django.db import migrations


def seed(apps, schema_editor):
    from compendium.schema import DEFAULT_NUMERIC_FIELDS

    NumericField = apps.get_model("compendium", "NumericField")
    for spec in DEFAULT_NUMERIC_FIELDS:
        NumericField.objects.get_or_create(
            name=spec.name,
            defaults={
                "kind": spec.kind.value,
                "min_value": spec.min,
                "max_value": spec.max,
                "sensitivity": spec.sensitivity,
                "unit": spec.unit,
                "description": spec.description,
            },
        )


class Migration(migrations.Migration):
    dependencies = [("compendium", "0001_initial")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
