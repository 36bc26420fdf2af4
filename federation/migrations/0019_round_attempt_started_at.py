from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('federation', '0018_round_attempt'),
    ]

    operations = [
        migrations.AddField(
            model_name='round',
            name='attempt_started_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
