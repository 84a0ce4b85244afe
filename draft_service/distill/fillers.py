"""Word lists that fill the prompt templates of ``draft_service.distill.prompts``: plain data, no logic.

Everything here is written for specdec; none of it comes from a published evaluation set.
"""

from __future__ import annotations

NAMES = [
    "Amara", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jakob", "Kofi", "Leila",
    "Mateo", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf",
    "Zoe", "Aiden", "Bianca", "Carlos", "Dana", "Emil", "Fatima", "Gustav", "Hannah", "Ivan", "Julia", "Kenji",
    "Lucia", "Marek", "Noor", "Olga", "Pablo", "Rania", "Samir", "Tess", "Ulrich", "Vera", "Wyatt", "Ximena",
]

PLACES = [
    "Alderbrook", "Bramwell", "Castlemoor", "Dunhaven", "Eastmere", "Fairholt", "Glenridge", "Harrowgate",
    "Ivybridge", "Kingsford", "Larchmont", "Marlow Bay", "Northfield", "Oakhurst", "Pinecrest", "Queensbury",
    "Redcliffe", "Stonebridge", "Thornbury", "Upton Vale", "Westbrook", "Yarrow Point", "Ashcombe", "Birchwood",
]

COMPANIES = [
    "Northwind Labs", "Bluepeak Systems", "Copperleaf Foods", "Driftwood Games", "Evergreen Energy",
    "Foxglove Health", "Granite Logistics", "Harbor Robotics", "Iris Optics", "Juniper Bank", "Kite Mobility",
    "Lumen Textiles", "Meadow Dairy", "Nimbus Cloud", "Orchid Pharma", "Pebble Audio", "Quarry Tools",
    "Riverstone Media", "Sable Security", "Tidewater Shipping",
]

PRODUCTS = [
    "a solar-powered backpack", "a folding electric bike", "a smart thermostat", "a noise-cancelling headset",
    "a budgeting app for students", "a plant-based cheese", "a compact 3D printer", "a water filter bottle",
    "a language-learning game", "a heat pump for small flats", "a reusable coffee cup", "a fitness tracker ring",
    "a cordless vacuum cleaner", "a children's coding kit", "an e-reader with a colour screen",
    "a wooden puzzle set", "a rain jacket made from recycled plastic", "a video doorbell", "a camping stove",
    "a standing desk",
]

EVENTS = [
    "a storm flooded several streets", "the town opened a new library", "a local team won the regional final",
    "a bridge was closed for repairs", "the council approved a new cycle lane", "a museum reopened after renovation",
    "volunteers planted two thousand trees", "a school launched a robotics club", "a factory switched to solar power",
    "a farmers' market moved to a new square", "the bus company changed its timetable", "a heatwave broke records",
    "a rare bird was spotted near the lake", "the hospital opened a new children's ward",
    "a festival attracted thousands of visitors", "the river reached its highest level in decades",
]

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the immune system", "inflation", "compound interest",
    "the French Revolution", "plate tectonics", "machine learning", "climate change", "vaccines", "the internet",
    "democracy", "renewable energy", "the Roman Empire", "DNA", "supply and demand", "volcanoes", "electricity",
    "the solar system", "antibiotics", "blockchain", "the printing press", "gravity", "evolution", "recycling",
    "the stock market", "earthquakes", "the human heart", "sleep", "coral reefs", "the Renaissance",
    "nuclear energy", "rainbows", "tides", "the greenhouse effect", "bees and pollination", "the Great Wall of China",
    "memory in the brain", "the Industrial Revolution", "rust and corrosion", "sound waves", "glaciers",
    "the speed of light", "composting", "public transport", "the metric system", "hurricanes", "bread baking",
    "the Olympic Games", "solar eclipses", "the periodic table", "encryption", "time zones", "batteries",
]

HOBBIES = [
    "running", "gardening", "painting with watercolours", "playing the guitar", "learning Spanish", "chess",
    "baking bread", "photography", "knitting", "rock climbing", "bird watching", "swimming", "yoga", "journaling",
    "woodworking", "cycling to work", "cooking Indian food", "playing the piano", "hiking", "pottery",
    "meditation", "board games", "learning to code", "sewing", "fishing", "dancing", "calligraphy", "camping",
]

SITUATIONS = [
    "moving to a new city", "starting a new job next week", "preparing for a job interview",
    "planning a birthday party for my sister", "trying to save money", "studying for an exam",
    "going on my first long-distance flight", "adopting a puppy", "looking after my elderly father",
    "working from home for the first time", "training for a 10 km race", "redecorating my bedroom",
    "organising a team meeting", "writing my first novel", "learning to drive", "visiting Japan in spring",
    "trying to sleep better", "hosting dinner for eight people", "starting university in the autumn",
    "teaching my kid to ride a bike", "feeling stressed at work", "planning a weekend trip with friends",
    "buying my first car", "setting up a small online shop", "getting back into exercise after an injury",
]

FOLLOW_UPS = [
    "How much time should I set aside for it each week?", "What should I avoid doing?",
    "Can you give me a simple plan for the first month?", "Is it expensive to get started?",
    "What if I only have ten minutes a day?", "Could you make that shorter?", "Why does that work?",
    "Can you give me an example?", "What would you do first?", "How will I know if I'm making progress?",
    "Is there anything I should buy?", "What are the most common mistakes?", "Thanks! Any other tips?",
    "Can you put that in a list?", "How do I stay motivated?", "What if it doesn't work for me?",
]

ASSISTANT_OPENERS = [
    "That sounds like a great idea. The most important thing is to start small and be consistent.",
    "Good question! It helps to break the task into a few simple steps.",
    "Happy to help. A little planning at the start makes everything easier later on.",
    "Sure. Many people find it easiest to begin with the basics and build up slowly.",
    "Of course. Here is a short overview to get you started.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a sentence", "removes duplicates from a list while keeping the order",
    "finds the second largest number in a list", "converts a temperature from Fahrenheit to Celsius",
    "merges two dictionaries", "flattens a nested list", "checks whether two strings are anagrams",
    "computes the factorial of a number", "returns the most common element of a list",
    "splits a list into chunks of size n", "validates an email address with a simple rule",
    "calculates the average of a list of numbers", "sorts a list of tuples by their second element",
    "capitalises the first letter of every word", "finds all even numbers in a list",
    "computes the greatest common divisor of two integers", "checks whether a year is a leap year",
    "converts a decimal number to binary", "counts the vowels in a string", "returns the sum of the digits of a number",
    "finds the longest word in a sentence", "rotates a list by k positions", "transposes a matrix",
    "reads a CSV file and returns its rows", "checks whether a string is a palindrome",
    "generates all permutations of a string", "computes the median of a list", "finds the intersection of two lists",
    "converts a Roman numeral to an integer", "implements binary search", "implements bubble sort",
    "counts how often each character occurs", "removes punctuation from a string",
    "returns the prime factors of a number", "checks whether brackets in a string are balanced",
    "computes the running total of a list", "parses a date string like 2024-05-17",
    "builds a dictionary from two lists", "finds the missing number in a list from 1 to n",
    "returns the first non-repeated character of a string", "checks whether a list is sorted",
    "compresses a string like aaabb into a3b2", "computes the dot product of two vectors",
    "returns the n largest values of a list", "converts seconds into hours, minutes and seconds",
    "validates a password against simple rules", "finds the index of the minimum value",
]

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "C", "C++", "Java", "Go", "Rust", "Ruby", "Bash", "SQL"]

CODE_CONCEPTS = [
    "a list comprehension", "a generator", "a decorator", "recursion", "a hash map", "a linked list",
    "a class and an object", "inheritance", "an exception", "a context manager", "a lambda function",
    "a closure", "an API", "a REST endpoint", "a unit test", "a race condition", "a deadlock", "Big O notation",
    "a binary tree", "a stack and a queue", "git branching", "a virtual environment", "type hints",
    "async and await", "a regular expression", "a database index", "a foreign key", "JSON", "a pointer",
    "memory management", "immutability", "dependency injection", "caching", "a thread pool",
]

CODE_HOWTO = [
    "read a file line by line", "sort a dictionary by its values", "reverse a list", "measure how long a function takes",
    "read command-line arguments", "send an HTTP request", "parse JSON", "write a list to a CSV file",
    "remove whitespace from both ends of a string", "check if a key exists in a dictionary",
    "generate a random number between 1 and 10", "get the current date and time", "create a directory if it does not exist",
    "iterate over two lists at the same time", "convert a string to an integer safely", "count lines in a file",
    "find all files with a given extension", "format a number with two decimal places", "join a list of strings",
    "copy a file", "run a shell command", "handle a division by zero", "make a class printable",
    "sort a list of objects by an attribute", "remove an item from a list by its value",
]

BUGGY_SNIPPETS = [
    ("def average(xs):\n    return sum(xs) / len(xs) + 1", "it should return the plain average"),
    ("def is_even(n):\n    return n % 2 == 1", "it returns the wrong answer for every number"),
    ("def last(xs):\n    return xs[len(xs)]", "it crashes with an IndexError"),
    ("def count_a(s):\n    n = 0\n    for c in s:\n        if c == 'a':\n            n =+ 1\n    return n", "it always returns 0 or 1"),
    ("def greet(name):\n    print('Hello, ' + name)\n\nmessage = greet('Ana')\nprint(message.upper())", "it raises an AttributeError"),
    ("def add_item(item, items=[]):\n    items.append(item)\n    return items", "items from earlier calls show up in later ones"),
    ("def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)", "it always returns 0"),
    ("total = 0\nfor i in range(1, 10):\n    total += i\nprint(total)  # should be the sum of 1..10", "the total is 45 instead of 55"),
    ("def minimum(xs):\n    best = 0\n    for x in xs:\n        if x < best:\n            best = x\n    return best", "it is wrong for lists of positive numbers"),
    ("def reverse_words(s):\n    return ' '.join(s.split().reverse())", "it raises a TypeError"),
]

QUESTIONS = [
    "Why is the sky blue?", "How do airplanes stay in the air?", "What causes the seasons?", "How does a refrigerator work?",
    "Why do we dream?", "What is the difference between weather and climate?", "How do vaccines train the immune system?",
    "Why does ice float on water?", "What makes a good password?", "How does GPS know where I am?",
    "Why do cats purr?", "What is a healthy breakfast?", "How do solar panels make electricity?",
    "Why is exercise good for the brain?", "What is the difference between a virus and a bacterium?",
    "How are mountains formed?", "Why do leaves change colour in autumn?", "How does a credit score work?",
    "What is the best way to learn a new language?", "Why does bread go stale?", "How do noise-cancelling headphones work?",
    "What is the difference between a crocodile and an alligator?", "How does a microwave oven heat food?",
    "Why is the ocean salty?", "How do bees make honey?", "What happens when we sleep?",
    "How do I write a good cover letter?", "What should I consider when choosing a laptop?",
    "Why do onions make people cry?", "How do electric cars compare with petrol cars?",
]

STYLES = [
    "", " Keep it short.", " Explain it to a ten-year-old.", " Use bullet points.", " Answer in one paragraph.",
    " Give two examples.", " Be concise.", " Use simple words.", " Answer in three sentences.",
]

TRANSLATION_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]

ENGLISH_SENTENCES = [
    "The train to the coast leaves every hour from platform three.",
    "My neighbour grows the sweetest strawberries I have ever tasted.",
    "Could you please close the window? It is getting cold in here.",
    "We are planning to visit our grandparents next weekend.",
    "The museum is free on the first Sunday of every month.",
    "I forgot my keys at the office, so I had to wait for my brother.",
    "The children built a snowman in the park this morning.",
    "Please send me the report before Friday afternoon.",
    "This restaurant serves the best soup in town.",
    "She has been learning to play the violin for two years.",
    "The library will be closed on Monday because of a public holiday.",
    "If it rains tomorrow, we will stay at home and watch a film.",
    "How much does a ticket to the city centre cost?",
    "Our flight was delayed by three hours because of fog.",
    "He always drinks a glass of water before breakfast.",
    "The new bridge makes the journey to the market much shorter.",
    "I would like to book a table for four people at eight o'clock.",
    "The teacher asked the students to read the first chapter at home.",
    "Where can I buy fresh bread around here?",
    "They painted the kitchen yellow to make it brighter.",
    "My phone battery dies quickly when it is very cold outside.",
    "The concert was cancelled, but they will refund our tickets.",
    "We walked along the river until the sun went down.",
    "Do you know a good dentist near the station?",
]

FOREIGN_SENTENCES = [
    ("French", "Je voudrais un café et un croissant, s'il vous plaît."),
    ("French", "Nous avons visité le château pendant les vacances d'été."),
    ("French", "Il fait très beau aujourd'hui, allons nous promener au parc."),
    ("French", "Ma sœur travaille dans une boulangerie depuis trois ans."),
    ("Spanish", "¿Dónde está la estación de tren más cercana?"),
    ("Spanish", "Mañana vamos a cocinar una paella con toda la familia."),
    ("Spanish", "El perro de mis vecinos ladra cada noche a las diez."),
    ("Spanish", "Me gusta leer en la terraza cuando hace sol."),
    ("German", "Ich habe gestern einen langen Spaziergang im Wald gemacht."),
    ("German", "Kannst du mir bitte das Salz geben?"),
    ("German", "Der Zug hat heute leider zwanzig Minuten Verspätung."),
    ("German", "Meine Großmutter backt jeden Sonntag einen Apfelkuchen."),
    ("Italian", "Domani andiamo al mare con i nostri amici."),
    ("Italian", "Questa pizza è la migliore che abbia mai mangiato."),
    ("Portuguese", "Eu gosto de ouvir música enquanto cozinho."),
    ("Portuguese", "A biblioteca fecha às seis horas da tarde."),
]

UNITS = [
    ("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000), ("minutes", "seconds", 60), ("metres", "centimetres", 100),
]

ITEMS = ["apples", "pencils", "books", "tickets", "cupcakes", "marbles", "stickers", "oranges", "notebooks", "flowers"]
