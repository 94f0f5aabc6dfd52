"""On-policy distillation (OPD) for slime-core: ``slime-core train --plugin grpo --plugin opd --opd-teacher ...``."""
