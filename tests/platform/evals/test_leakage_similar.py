"""The guard's reworded-request rule on a second labeled set: pairs reworded the way a template generator
rewords (a greeting added, a clause moved, one verb swapped) and different requests that share most words
(another id, amount, name, day or action). Its first threshold was chosen on these pairs; the guard's own
figures are measured on the hand-written pairs (test_leakage_pairs.py). Also the literal values, the
action and the direction, read from the words (`flywheel.evals.rewording`). No database."""

from __future__ import annotations

import pytest

from flywheel.evals import leakage, rewording
from flywheel.evals import rows as row_shape

pytestmark = pytest.mark.django_db  # the guard keeps request vectors in the database

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
    """Does the guard (every rule on requests) refuse them as the same request?"""
    return any(not c.confirmable for c in leakage.conflicts_between([_candidate("a", a)], [_candidate("b", b)]))


def test_precision_and_recall_on_the_generated_pairs():
    leakage._vectors(tuple({text for pair in SAME + DIFFERENT for text in pair}))  # one batch for the model
    found = [pair for pair in SAME if _flagged(*pair)]
    wrong = [pair for pair in DIFFERENT if _flagged(*pair)]
    precision = len(found) / (len(found) + len(wrong)) if found or wrong else 1.0
    recall = len(found) / len(SAME)
    print(f"\n{len(SAME)} reworded pairs, {len(DIFFERENT)} different requests sharing words: "
          f"precision {precision:.3f}, recall {recall:.3f}\n  missed {[p for p in SAME if p not in found]}"
          f"\n  wrongly refused {wrong}")
    # Measured 1.00 and 30 of 30 (the distilled embedding at 0.90 had 0.85 and 0.77); the one different
    # request refused is a long one whose one changed word barely moves the vector.
    assert precision >= 0.9 and recall >= 0.9, (precision, recall)
    assert not [pair for pair in wrong if any(ch.isdigit() for ch in pair[0] + pair[1])
                and rewording.facts(pair[0]).literals != rewording.facts(pair[1]).literals]


def _same_words(a: str, b: str) -> bool:
    return rewording.disagreement(rewording.facts(a), rewording.facts(b)) is None


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
    # Amounts, dates, times, ids and quoted names, however they are written.
    ("Transfer $250 to savings", "Transfer 250 dollars to savings", True),
    ("Transfer $250 to savings", "Transfer 250 euros to savings", False),
    ("Transfer $1.5k to savings", "Transfer 1500 dollars to savings", True),
    ("Book it for May 3rd", "Book it for May 3", True),
    ("Book it for May 3rd", "Book it for the 3rd of May", True),
    ("Book it for May 3rd", "Book it for May 13", False),
    ("May I book it for Tuesday?", "Book it for tuesday", True),  # "May" is a month only beside a number
    ("Wake me at 10am", "Wake me at 10 in the morning", True),
    ("Wake me at 10am", "Wake me at 10 in the evening", False),
    ("Wake me at 3pm", "Wake me at 15:00", True),
    ("Check flight UA 452", "Check flight UA452", True),
    ("Check flight UA 452", "Check flight UA 542", False),
    ("Open the folder \"Tax 2023\"", "Open the Tax 2023 folder", True),
    ("Open the folder \"Tax 2023\"", "Open the Tax 2024 folder", False),
    ("Table for four", "table for 4", True),
    ("Meet next Tuesday", "Meet on Tuesday next week", True),
    # The action and the direction.
    ("Add Priya to the review", "Remove Priya from the review", False),
    ("Add Priya to the review", "Take Priya off the review", False),
    ("Turn on the porch light", "Switch the porch light off", False),
    ("Show the paid invoices", "Which invoices haven't been paid?", False),
    ("Mark it as read", "Mark it as unread", False),
    ("Cancel my subscription", "Upgrade my subscription", False),
    ("Freeze my card", "Please block my card", True),
    ("Move $200 from checking to savings", "Move $200 from savings to checking", False),
    ("Move $200 from checking to savings", "Transfer $200 from my checking account into savings", True),
    ("Convert 100 USD to EUR", "Convert 100 EUR to USD", False),
    ("Refund the charge on order 4410", "Why was I charged on order 4410?", False),
])
def test_literal_values_action_and_direction_are_compared(a, b, same):
    assert _same_words(a, b) is same


def test_an_email_is_read_from_the_start_of_its_run_only_so_a_long_run_is_read_once():
    """The email pattern was tried at every character of a run of its own characters and read to the run's end
    from each: " a" and 200,000 dots after a real request (which the model's 256 tokens never reach, so the
    pair's words are read) took 155 s in one request, 1.9 s since (measured; speed is not asserted here). An
    email now starts only where its run starts: read from inside the run, there is none."""
    started_inside = rewording._TOKEN.match("x..y@example.com", 2)
    assert started_inside is None or started_inside.lastgroup != "email"
    assert [m.group() for m in rewording._TOKEN.finditer("write to ann.lee@example.com today") if m.lastgroup == "email"] == ["ann.lee@example.com"]
    request = "Please refund 50.00 on order A-1001, the mug arrived broken."
    assert rewording.facts(request + " a" + "." * 20_000).literals == rewording.facts(request).literals


def test_the_sentence_vectors_alone_cannot_tell_ids_apart():
    """Why the literal check exists: the sentence model weighs digits little, so two ids are as close as
    a rewording."""
    vectors = leakage._vectors(("Look up customer C-17", "Look up customer C-71"))
    assert float(vectors[0] @ vectors[1]) >= rewording.REWORDED_COSINE
    assert not _flagged("Look up customer C-17", "Look up customer C-71")


def test_the_guard_runs_the_whole_model_as_sentence_transformers_does():
    """`SentenceModel.encode` is all-MiniLM-L6-v2's embedding: the transformer, mean pooling over the tokens,
    normalised (the packaged model's modules.json), read offline from the package."""
    from sentence_transformers import SentenceTransformer

    from flywheel.failures.clustering.embedding import shared_model

    texts = ["Could you book a meeting with Bob on Tuesday?", "Please set up a meeting with Bob for Tuesday.", "",
             "word " * 400]  # the last is cut at the model's 256 tokens, as sentence-transformers cuts it
    model = shared_model()
    reference = SentenceTransformer(str(model.model_dir), device="cpu", local_files_only=True)
    assert abs(model.encode(texts) - reference.encode(texts, normalize_embeddings=True)).max() < 1e-5


def test_a_request_runs_through_the_model_once(monkeypatch):
    """Its vector is kept in the database: a fresh process (no vectors in memory) reads it back rather than
    running the model over a whole side again."""
    from flywheel.failures.clustering import embedding

    leakage._vector_cache.clear()
    first = leakage._vectors(("Renew my library books.",))
    leakage._vector_cache.clear()

    def no_model() -> None:
        raise AssertionError("the model ran again for a request whose vector is stored")

    monkeypatch.setattr(embedding, "shared_model", no_model)
    assert (leakage._vectors(("Renew my library books.",)) == first).all()
