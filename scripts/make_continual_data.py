"""Write the forgetting probes of the continual-learning recipe (docs/real-model.md) into assets/.

- ``capitals_eval.jsonl``: "What is the capital of X?" for 60 countries, ``answer`` the city: a
  task the base SmolLM2-135M-Instruct does well before any fine-tuning (the earlier task whose
  accuracy a fine-tune on sums may erode);
- ``general_text.jsonl``: 24 short paragraphs of plain encyclopedic English written for this
  repository (``text``): general text the base model predicts well, whose NLL per token
  measures how far a fine-tune moved the model's language modelling.

    python scripts/make_continual_data.py
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "grimoire" / "assets"
QUESTION = "What is the capital of {country}? Answer with the city name only."

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "the United Kingdom": "London",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "the Netherlands": "Amsterdam",
    "Austria": "Vienna",
    "Greece": "Athens",
    "Poland": "Warsaw",
    "Hungary": "Budapest",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Russia": "Moscow",
    "Ukraine": "Kyiv",
    "Czechia": "Prague",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Serbia": "Belgrade",
    "Croatia": "Zagreb",
    "Iceland": "Reykjavik",
    "Japan": "Tokyo",
    "China": "Beijing",
    "South Korea": "Seoul",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "the Philippines": "Manila",
    "Malaysia": "Kuala Lumpur",
    "Pakistan": "Islamabad",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Israel": "Jerusalem",
    "Saudi Arabia": "Riyadh",
    "Turkey": "Ankara",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Ethiopia": "Addis Ababa",
    "Morocco": "Rabat",
    "Ghana": "Accra",
    "the United States": "Washington",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Peru": "Lima",
    "Colombia": "Bogota",
    "Venezuela": "Caracas",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Afghanistan": "Kabul",
    "Bangladesh": "Dhaka",
}

GENERAL_TEXT = [
    "The sun is a star at the centre of our solar system. It gives light and heat to the Earth, "
    "and without it there would be no life on our planet. The Earth travels around the sun once "
    "every year.",
    "Water covers most of the surface of the Earth. Most of it is salt water in the oceans, and "
    "only a small part is fresh water in rivers, lakes and ice. People need fresh water to drink "
    "and to grow food.",
    "A year has twelve months and four seasons. In spring the days grow longer and plants begin "
    "to grow. Summer is the warmest season, autumn brings falling leaves, and winter is the "
    "coldest time of the year.",
    "Trees take in carbon dioxide from the air and give out oxygen. Their roots hold the soil in "
    "place, and their leaves give shade. Forests are home to many kinds of animals, birds and "
    "insects.",
    "The human heart is a muscle that pumps blood through the body. Blood carries oxygen and food "
    "to every cell and takes away waste. A healthy heart beats about seventy times a minute at "
    "rest.",
    "Bread is made from flour, water, salt and yeast. The yeast makes the dough rise, and baking "
    "it in a hot oven gives the bread its crust. People have baked bread for thousands of years.",
    "Computers store information as numbers. A program is a list of instructions that tells the "
    "computer what to do, step by step. Programmers write these instructions in programming "
    "languages such as Python.",
    "The moon travels around the Earth about once a month. It has no light of its own; it shines "
    "because it reflects the light of the sun. Its pull on the oceans causes the tides.",
    "Bees collect nectar from flowers and turn it into honey. As they move from flower to flower "
    "they carry pollen, which helps plants make seeds and fruit. Many of the foods we eat depend "
    "on bees.",
    "A library is a place where people can borrow books for free. Many libraries also lend music "
    "and films, and offer computers for public use. Librarians help readers find the information "
    "they need.",
    "Exercise is good for the body and the mind. Walking, running, swimming and cycling make the "
    "heart and lungs stronger. Doctors say that adults should be active for at least thirty "
    "minutes on most days.",
    "Rain forms when water vapour in clouds cools and turns into drops. When the drops become too "
    "heavy, they fall to the ground. In cold weather they may fall as snow instead of rain.",
    "The alphabet used for English has twenty-six letters. Five of them are vowels: a, e, i, o "
    "and u. Letters are put together to make words, and words are put together to make sentences.",
    "Mountains are formed over millions of years as the plates of the Earth's crust push against "
    "each other. The highest mountain in the world is Mount Everest, in the Himalayas.",
    "Cats and dogs are the most popular pets in many countries. Dogs are known for their loyalty "
    "and need to be walked every day. Cats are more independent and spend much of the day asleep.",
    "A healthy diet includes fruit, vegetables, grains and protein. Eating too much sugar and "
    "salt can lead to health problems. Drinking enough water every day is also important.",
    "The internet connects computers all over the world. It lets people send messages, share "
    "pictures and read the news in seconds. Today many people use it for work, school and "
    "shopping.",
    "Farmers grow crops such as wheat, rice and corn, and raise animals for milk, eggs and meat. "
    "Their work depends on the weather, the soil and the seasons.",
    "Music is made of sounds arranged in time. A melody is a series of notes, and rhythm is the "
    "pattern of long and short sounds. People in every culture sing, dance and play instruments.",
    "Electric cars run on batteries instead of petrol. They are quiet and produce no exhaust "
    "fumes while driving. Their batteries are charged by plugging the car into the power grid.",
    "Schools teach children to read, write and count. Students also learn about science, history "
    "and the world around them. Teachers plan lessons and help each student learn.",
    "The ocean is home to fish, whales, dolphins and many other creatures. Coral reefs are among "
    "the richest places for life in the sea, but they are harmed by warmer water and pollution.",
    "A map is a drawing of a place as seen from above. It shows roads, rivers, towns and borders. "
    "A compass helps travellers find north, so that they can read the map the right way.",
    "Sleep helps the body rest and the brain store memories. Most adults need seven to nine "
    "hours of sleep each night. Children and teenagers need even more.",
]


def main() -> None:
    rows = {
        "capitals_eval.jsonl": [
            {"prompt": [{"role": "user", "content": QUESTION.format(country=c)}], "answer": a}
            for c, a in CAPITALS.items()
        ],
        "general_text.jsonl": [{"text": t} for t in GENERAL_TEXT],
    }
    for name, items in rows.items():
        with open(ASSETS / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
        print(f"wrote {ASSETS / name} ({len(items)} rows)")


if __name__ == "__main__":
    main()
