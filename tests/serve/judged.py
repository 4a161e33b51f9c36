"""A feedback judge that writes down every turn it judges (for the restart test)."""

import os

from composer_lightning.tasks.feedback import FeedbackScore


class LoggedFeedbackScore(FeedbackScore):
    """`FeedbackScore` that appends the id of each turn it scores to `$JUDGED_LOG`."""

    def score(self, problems, completions):
        with open(os.environ["JUDGED_LOG"], "a") as f:
            f.writelines(f"{p['turn_id']}\n" for p in problems)
        return super().score(problems, completions)
