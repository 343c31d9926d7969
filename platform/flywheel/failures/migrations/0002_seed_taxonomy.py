"""Every existing project gets the field's failure categories (new projects get them from project_create)."""

from django.db import migrations

# Frozen here: a migration must not change when the app's own list changes later.
CATEGORIES = [
    ("format", "Format", "The output is malformed: arguments that are not JSON, a wrong answer format."),
    ("wrong_tool", "Wrong tool", "The agent called a tool that does not fit the step."),
    ("wrong_arguments", "Wrong arguments", "The right tool, called with wrong or schema-breaking arguments."),
    ("hallucinated_api", "Hallucinated API", "A call to a tool or API the agent was never given."),
    ("bad_planning", "Bad planning", "Loops, missing steps, or an episode that ends without an answer."),
    ("unsafe_action", "Unsafe action", "An action the project's policy forbids."),
    ("retrieval_error", "Retrieval error", "The agent looked up the wrong thing or misread what it found."),
    ("other", "Other", "Anything the other categories do not cover."),
]


def seed(apps, schema_editor):
    Project = apps.get_model("accounts", "Project")
    TaxonomyCategory = apps.get_model("failures", "TaxonomyCategory")
    rows = [
        TaxonomyCategory(project_id=project_id, key=key, name=name, description=description, position=position)
        for project_id in Project.objects.values_list("id", flat=True)
        for position, (key, name, description) in enumerate(CATEGORIES)
    ]
    TaxonomyCategory.objects.bulk_create(rows, ignore_conflicts=True, batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [("failures", "0001_initial")]

    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
