"""The guard's reworded-request rule on a labeled set: pairs that ask the same thing in other words, and
pairs of different requests that share most of their words (another id, amount, name, day or action).

The threshold (`leakage.SIMILAR_COSINE`) was chosen on these same pairs, so the figures are in-sample: run
with -s to see precision and recall at each threshold. No database: the rule works on requests alone."""

from __future__ import annotations

import pytest

from flywheel.evals import leakage
from flywheel.evals import rows as row_shape

# (a, b): the same request, reworded.
SAME = [
    ("Please look up customer C-17 for me", "Look up customer C-17"),
    ("Look up customer C-17", "Can you look up customer C-17?"),
    ("Could you book a meeting with bob on tuesday?", "Book a meeting with bob on tuesday."),
    ("Book a meeting with alice on tuesday.", "Hi! Book a meeting with alice on tuesday."),
    ("Book a meeting with alice on tuesday.", "Could you help me with this: Book a meeting with alice on tuesday."),
    ("Book a meeting with alice on tuesday.", "Book a meeting with alice on tuesday. Thanks in advance."),
    ("Book a meeting with alice on tuesday.", "I need this done, please. Book a meeting with alice on tuesday."),
    ("Please refund 50.00 on order A-1001, the mug arrived broken.", "Refund 50 on order A-1001, the mug arrived broken"),
    ("Please refund 50.00 on order A-1001, the mug arrived broken.",
     "The mug arrived broken, please refund 50.00 on order A-1001."),
    ("Cancel my order 5512", "Hey, cancel order #5512 please"),
    ("What is the status of ticket T-4410?", "what's the status of ticket T-4410"),
    ("Reset the password for jane@example.com", "Please reset the password for jane@example.com, thanks!"),
    ("Send the Q3 report to Maria", "Can you send Maria the Q3 report?"),
    ("Find flights from Paris to Berlin on May 3", "Please find me flights from Paris to Berlin on May 3."),
    ("Create a ticket: the printer on floor 2 is jammed", "Open a ticket, the printer on floor 2 is jammed"),
    ("Show me the last 10 orders of customer C-88", "Could you show me the last 10 orders of customer C-88?"),
    ("Update the shipping address of order A-2002 to 12 Main Street",
     "Please update the shipping address for order A-2002 to 12 Main Street."),
    ("Delete the draft invoice INV-301", "Go ahead and delete the draft invoice INV-301"),
    ("How many users signed up yesterday?", "how many users signed up yesterday"),
    ("Book a table for 4 at 7pm tonight", "Can you book a table for 4 at 7pm tonight?"),
    ("Look up customer C-17", "Look up the customer C17"),
    ("Escalate ticket T-99 to the billing team", "Please escalate T-99 to the billing team."),
    ("Add bob to the design channel", "Could you add bob to the design channel?"),
    ("Schedule a call with carol friday at 3pm", "Schedule a call with carol at 3pm on friday, please"),
    ("Refund order A-1001", "I want a refund for order A-1001"),
    ("Look up customer C-17", "Find customer C-17"),
    ("Cancel my subscription", "I'd like to cancel my subscription, please."),
    ("Transfer 200 dollars from checking to savings", "Move 200 dollars from checking to savings"),
    ("What's the weather in Lisbon tomorrow?", "Tell me tomorrow's weather in Lisbon"),
    ("Archive all emails from newsletter@shop.com", "Please archive every email from newsletter@shop.com"),
]

# (a, b): different requests that share most words.
DIFFERENT = [
    ("Look up customer C-17", "Look up customer C-71"),
    ("Please look up customer C-17 for me", "Please look up customer C-18 for me"),
    ("Book a meeting with alice on tuesday.", "Book a meeting with bob on tuesday."),
    ("Book a meeting with bob on tuesday.", "Book a meeting with bob on friday."),
    ("Look up customer C-17", "Delete customer C-17"),
    ("Refund order A-1001", "Cancel order A-1001"),
    ("Please refund 50.00 on order A-1001, the mug arrived broken.",
     "Please refund 500.00 on order A-1001, the mug arrived broken."),
    ("Please refund 50.00 on order A-1001, the mug arrived broken.",
     "Please refund 50.00 on order A-1002, the mug arrived broken."),
    ("Please refund 50.00 on order A-1001, the mug arrived broken.",
     "Please refund 50.00 on order A-1001, the lamp arrived broken."),
    ("Cancel my order 5512", "Track my order 5512"),
    ("What is the status of ticket T-4410?", "Close ticket T-4410"),
    ("Reset the password for jane@example.com", "Reset the password for john@example.com"),
    ("Send the Q3 report to Maria", "Send the Q4 report to Maria"),
    ("Send the Q3 report to Maria", "Send the Q3 report to Pedro"),
    ("Find flights from Paris to Berlin on May 3", "Find flights from Paris to Madrid on May 3"),
    ("Find flights from Paris to Berlin on May 3", "Find hotels in Berlin on May 3"),
    ("Show me the last 10 orders of customer C-88", "Show me the last 20 orders of customer C-88"),
    ("Update the shipping address of order A-2002 to 12 Main Street",
     "Update the billing address of order A-2002 to 12 Main Street"),
    ("Delete the draft invoice INV-301", "Send the draft invoice INV-301"),
    ("How many users signed up yesterday?", "How many users cancelled yesterday?"),
    ("Book a table for 4 at 7pm tonight", "Book a table for 2 at 7pm tonight"),
    ("Escalate ticket T-99 to the billing team", "Escalate ticket T-99 to the security team"),
    ("Add bob to the design channel", "Remove bob from the design channel"),
    ("Add bob to the design channel", "Add alice to the design channel"),
    ("Schedule a call with carol friday at 3pm", "Schedule a call with carol friday at 4pm"),
    ("Cancel my subscription", "Upgrade my subscription"),
    ("Transfer 200 dollars from checking to savings", "Transfer 200 dollars from savings to checking"),
    ("What's the weather in Lisbon tomorrow?", "What's the weather in Porto tomorrow?"),
    ("Archive all emails from newsletter@shop.com", "Delete all emails from newsletter@shop.com"),
    ("Book a meeting with bob on tuesday at the downtown office to go over the quarterly budget review and hiring plan",
     "Book a meeting with alice on tuesday at the downtown office to go over the quarterly budget review and hiring plan"),
    ("Please look up the order history, open tickets and billing address of customer C-17 and summarise them",
     "Please look up the order history, open tickets and shipping address of customer C-17 and summarise them"),
    ("Look up customer C-17", "Look up customer C-17 and refund order A-1001"),
]


def _candidate(label: str, text: str) -> leakage.Candidate:
    messages = [{"role": "user", "content": text}]
    return leakage.Candidate(label, None, row_shape.prompt_digest(messages), text)


def _flagged(a: str, b: str) -> bool:
    """Does the guard (every rule on requests: the normalised one and the reworded one) call them the same?"""
    return bool(leakage.conflicts_between([_candidate("a", a)], [_candidate("b", b)]))


def _scores() -> tuple[float, float, list[tuple[str, str]], list[tuple[str, str]]]:
    found = [pair for pair in SAME if _flagged(*pair)]
    false = [pair for pair in DIFFERENT if _flagged(*pair)]
    precision = len(found) / (len(found) + len(false)) if found or false else 1.0
    return precision, len(found) / len(SAME), [p for p in SAME if p not in found], false


def test_precision_and_recall_on_the_labeled_pairs(monkeypatch):
    chosen = leakage.SIMILAR_COSINE
    print(f"\n{len(SAME)} reworded pairs, {len(DIFFERENT)} different requests sharing words")
    for threshold in (0.85, 0.88, 0.90, 0.92, 0.95, 0.97):
        monkeypatch.setattr(leakage, "SIMILAR_COSINE", threshold)
        precision, recall, _, _ = _scores()
        print(f"  cosine >= {threshold:.2f}: precision {precision:.3f}  recall {recall:.3f}"
              + ("   <- chosen" if threshold == chosen else ""))
    monkeypatch.setattr(leakage, "SIMILAR_COSINE", chosen)
    precision, recall, missed, wrong = _scores()
    print(f"at {chosen:.2f}: missed {missed}\n  wrongly flagged {wrong}")
    # Measured 0.85 and 0.77 here; a little slack for another CPU's numerics on pairs near the threshold.
    assert precision >= 0.8 and recall >= 0.7, (precision, recall)
    # The reported leak is found; requests that differ only in an id or an amount never are.
    assert _flagged("Look up customer C-17", "Please look up customer C-17 for me")
    assert _flagged("Could you book a meeting with bob on tuesday?", "Book a meeting with bob on tuesday.")
    assert not [pair for pair in wrong if any(ch.isdigit() for ch in pair[0] + pair[1])
                and leakage.request_literals(pair[0])[0] != leakage.request_literals(pair[1])[0]]


@pytest.mark.parametrize(("a", "b", "same"), [
    ("Look up customer C-17", "Look up customer C-71", False),
    ("Look up customer C-17", "look up the customer C17", True),
    ("Refund 50.00 on A-1", "refund 50 on a-1", True),
    ("Refund 50.00 on A-1", "Refund 500 on A-1", False),
    ("Pay 1,000 to Acme", "pay 1000 to acme", True),
    ("Look up customer C-17", "Look up customer C-17 and refund order A-1001", False),
    ("Send it to Maria", "send it to maria", True),
    ("Send it to Maria", "Send it to Pedro", False),
    ("Hi! Book a room. Thanks", "book a room", True),  # words that start a sentence are not names
    ("Mail jane@example.com", "Mail john@example.com", False),
])
def test_literal_values_are_compared_exactly(a, b, same):
    assert leakage.same_literals(a, b) is same


def test_the_embedding_alone_cannot_tell_ids_apart():
    """Why the literal check exists: the sentence embedding weighs digits little."""
    vectors = leakage._vectors(("Look up customer C-17", "Look up customer C-71"))
    assert float(vectors[0] @ vectors[1]) >= 0.99
    assert not _flagged("Look up customer C-17", "Look up customer C-71")
