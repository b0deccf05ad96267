"""Prompts the model answers itself, for training on its own writing: Medusa heads and
distilled students (self-distillation).

Written for brisk in the style of MT-Bench's eight categories, plus everyday chat, so heads
see the kinds of answers a chat model writes: prose, dialogue, step-by-step reasoning,
arithmetic, code, structured extraction, science and essays. They ship as code rather than a
data file so they travel with the package and nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from brisk.sample.params import SamplingParams

if TYPE_CHECKING:
    from brisk.llm import LLM

_TOP_P = 0.9  # with temperature: brisk's own default (BRISK_DEFAULTS)

PROMPTS: dict[str, tuple[str, ...]] = {
    "writing": (
        "Write a short blog post about a weekend trip to a small coastal town, mentioning the food and the people.",
        "Draft a polite email to a landlord asking for a leaking kitchen tap to be repaired this week.",
        "Write a product description for a reusable water bottle that keeps drinks cold for a full day.",
        "Compose a four-line poem about the first snow of winter.",
        "Write the opening paragraph of a mystery story set in a quiet library.",
        "Write a thank-you note to a teacher who helped you prepare for an important exam.",
        "Write a short speech for a friend's wedding that is warm and a little funny.",
        "Describe a busy morning market using all five senses.",
        "Write a cover letter for a junior web developer position at a small startup.",
        "Write a persuasive paragraph encouraging people to take the stairs instead of the elevator.",
        "Write a bedtime story about a lighthouse keeper and a lost seagull.",
        "Rewrite this sentence to sound more formal: 'Hey, we can't make it to the meeting, sorry about that.'",
    ),
    "roleplay": (
        "Pretend you are a tour guide in ancient Rome. Welcome a group of visitors to the Forum.",
        "You are a chef on a cooking show. Explain how you are making a simple tomato pasta sauce.",
        "Act as a detective interviewing a witness about a stolen painting. Ask your first questions.",
        "You are a friendly librarian. Recommend three books to a teenager who loves adventure.",
        "Imagine you are a pirate captain giving a pep talk to your crew before a storm.",
        "You are a personal trainer. Give a beginner a motivating plan for their first week at the gym.",
        "Pretend to be a robot that has just learned what music is. Describe your first song.",
        "You are a medieval innkeeper. Greet a tired traveller and describe what you can offer.",
        "Act as a customer support agent helping someone who forgot their password.",
        "You are an astronaut on the International Space Station. Describe your morning routine.",
        "Play the role of a wise old tree talking to a child who is sitting under its branches.",
        "You are a sports commentator. Narrate the last minute of a close basketball game.",
    ),
    "reasoning": (
        "If all roses are flowers and some flowers fade quickly, can we conclude that some roses fade quickly? Explain.",
        "Tom is taller than Anna. Anna is taller than Ben. Who is the shortest? Explain your reasoning.",
        "A farmer has 17 sheep and all but 9 run away. How many are left? Explain.",
        "There are three boxes: one has apples, one has oranges, one has both. All labels are wrong. "
        "How can you label them correctly by taking one fruit from one box?",
        "If it takes five machines five minutes to make five widgets, how long do 100 machines need "
        "to make 100 widgets?",
        "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain.",
        "A clock shows 3:15. What is the angle between the hour and minute hands?",
        "You overtake the person in second place in a race. What place are you in now?",
        "Sarah's father has five daughters: Nana, Nene, Nini, Nono. What is the fifth daughter's name?",
        "If today is Wednesday, what day of the week will it be in 100 days? Show the steps.",
        "A bat and a ball cost 1.10 dollars in total. The bat costs one dollar more than the ball. "
        "How much does the ball cost?",
        "Explain why a mirror seems to swap left and right but not up and down.",
    ),
    "math": (
        "What is 15 percent of 240? Show your work.",
        "Solve for x: 3x + 7 = 22.",
        "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area?",
        "What is the sum of the first 20 positive integers?",
        "Simplify the fraction 84/126.",
        "A train travels 180 km in 2.5 hours. What is its average speed in km per hour?",
        "Find the greatest common divisor of 48 and 180.",
        "What is the probability of rolling a sum of 7 with two fair dice?",
        "Expand (x + 3)(x - 5).",
        "A shirt costs 40 dollars and is discounted by 25 percent, then by another 10 percent. What is the final price?",
        "How many different ways can you arrange the letters of the word LEVEL?",
        "What is the derivative of 3x^2 + 2x - 5?",
    ),
    "coding": (
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a Python function that returns the n-th Fibonacci number using iteration.",
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Write a SQL query that finds the five customers with the highest total order amount.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a Python function that counts how many times each word appears in a text.",
        "Explain what a binary search is and write it in Python.",
        "Write a bash command that finds all .log files larger than 10 MB in a directory.",
        "Write a Python class for a simple bank account with deposit and withdraw methods.",
        "What does the 'git rebase' command do, and when would you use it instead of merge?",
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Write a regular expression that matches a valid email address and explain each part.",
    ),
    "extraction": (
        "Extract the names and ages from this text as a list: 'Maria is 34, her brother Luis is 29, "
        "and their grandmother Elena turned 81 last spring.'",
        "From the following review, list the pros and cons: 'The laptop is light and the battery lasts "
        "all day, but the keyboard feels cheap and the screen is dim outdoors.'",
        "Summarize this in one sentence: 'The city council met on Tuesday to discuss the new bike lanes. "
        "After a long debate, members voted to build them on three main streets starting next year.'",
        "Identify the dates mentioned in this text: 'The project started on March 3, the first review "
        "was on April 15, and the launch is planned for June 30.'",
        "Turn this into a JSON object with fields name, city and job: 'Priya works as a nurse in Toronto.'",
        "List the ingredients mentioned: 'Mix two cups of flour with a teaspoon of salt, add three eggs "
        "and a cup of milk, then stir in melted butter.'",
        "What is the main topic of this paragraph? 'Bees pollinate many of the crops we eat. Without "
        "them, fruits like apples and almonds would become rare and expensive.'",
        "Extract every company name from this sentence: 'Analysts compared results from Orbitek, "
        "Greenfield Foods and Nova Logistics after the third quarter.'",
        "Classify the sentiment of each sentence as positive, negative or neutral: 'I loved the movie.' "
        "'The bus was late again.' 'The meeting is at noon.'",
        "Pull out the key numbers from this text: 'Sales rose 12 percent to 4.5 million units, while "
        "costs fell by 3 percent.'",
        "Rewrite these notes as a bulleted to-do list: 'call the dentist, buy milk and bread, finish "
        "the report by Friday, water the plants'.",
        "Find the question being asked in this message and answer it: 'Hi! I moved here last month. "
        "By the way, what time does the post office usually close?'",
    ),
    "stem": (
        "Explain how photosynthesis works in simple terms.",
        "Why is the sky blue during the day and red at sunset?",
        "What is the difference between a virus and a bacterium?",
        "Explain Newton's three laws of motion with an everyday example for each.",
        "How does a vaccine train the immune system?",
        "What causes the seasons on Earth?",
        "Explain what DNA is and why it matters.",
        "How do electric cars store and use energy?",
        "What is the water cycle? Describe each stage.",
        "Explain the difference between weather and climate.",
        "How does a computer's CPU execute instructions?",
        "What is an atom made of, and how were its parts discovered?",
    ),
    "humanities": (
        "What were the main causes of the First World War?",
        "Explain the idea of supply and demand with an example.",
        "Why was the printing press such an important invention?",
        "Describe the main features of Renaissance art.",
        "What is the difference between a democracy and a republic?",
        "Explain what inflation is and how it affects ordinary people.",
        "Why did the Roman Empire decline? Give several reasons.",
        "What is utilitarianism? Give an example of a moral choice it would guide.",
        "Describe the role of the Silk Road in connecting different cultures.",
        "How did the Industrial Revolution change daily life?",
        "What makes a novel a classic? Discuss with examples.",
        "Explain the purpose of the separation of powers in government.",
    ),
    "chat": (
        "Hi! How are you today?",
        "Can you recommend a good movie for a rainy evening?",
        "What are some easy dinner ideas for someone who is tired after work?",
        "I can't sleep. Do you have any tips?",
        "What's a fun hobby I could start this year?",
        "How do I stay motivated when learning a new language?",
        "Tell me a joke about cats.",
        "What should I pack for a three-day hiking trip?",
        "How can I be more productive when working from home?",
        "Give me three ideas for a friend's birthday present.",
        "What are the benefits of drinking enough water?",
        "How do I politely say no when someone asks me for a favor?",
    ),
}


@dataclass(frozen=True)
class Transcript:
    """A prompt rendered with the chat template and the model's answer to it."""

    token_ids: list[int]
    prompt_len: int


def training_prompts(count: int | None) -> list[str]:
    """The first `count` prompts, taken round-robin over the categories so any count mixes them."""
    columns = list(PROMPTS.values())
    ordered = [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]
    return ordered[:count]


def answer_prompts(llm: LLM, prompts: list[str], temperature: float, max_new_tokens: int,
                   progress: bool = False) -> list[Transcript]:
    """The model's answers (greedy at temperature 0), each with its rendered prompt, written by
    brisk's engine with continuous batching."""
    params = SamplingParams(temperature=temperature, top_p=_TOP_P if temperature > 0 else 1.0,
                            max_tokens=max_new_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=progress)
    return [Transcript(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in outputs]
