from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('routing', '0004_routing_call_batch'),
    ]

    operations = [
        migrations.AddField(
            model_name='tunedrouter',
            name='queued_at',
            field=models.DateTimeField(null=True),
        ),
        migrations.AddField(
            model_name='tunedrouter',
            name='requeues',
            field=models.PositiveSmallIntegerField(default=0),
        ),
    ]
