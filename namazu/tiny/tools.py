"""Tool (function) definitions for the generated tool-call transcripts, and their value generators.

Each tool exists in Japanese and English (descriptions of the tool and of every property), so one
definition yields a JSON schema in either language. `TRAIN_TOOLS` are used to build training data;
`HELDOUT_TOOLS` are never rendered into training data and only used by the evaluation, so the evaluation
measures whether the model reads an unseen schema rather than remembering one.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prop:
    """One argument: JSON type, descriptions, and how example values are drawn."""

    key: str
    type: str  # string | integer | number | boolean | array | object
    ja: str
    en: str
    kind: str = "text"  # value pool for strings / array items
    enum: tuple[str, ...] = ()
    minimum: int = 0
    maximum: int = 100
    items: str = "string"  # item type of arrays
    props: tuple[Prop, ...] = ()  # members of an object
    required: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    ja: str
    en: str
    props: tuple[Prop, ...]
    strict: bool = False  # additionalProperties: false
    result_keys: tuple[str, ...] = field(default=("status",))

    def schema(self, lang: str) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.ja if lang == "ja" else self.en,
            "parameters": _object_schema(self.props, lang, self.strict),
        }

    def openai(self, lang: str) -> dict[str, Any]:
        return {"type": "function", "function": self.schema(lang)}


def _prop_schema(p: Prop, lang: str) -> dict[str, Any]:
    s: dict[str, Any] = {"type": p.type, "description": p.ja if lang == "ja" else p.en}
    if p.enum:
        s["enum"] = list(p.enum)
    if p.type in ("integer", "number"):
        s["minimum"], s["maximum"] = p.minimum, p.maximum
    if p.type == "array":
        s["items"] = {"type": p.items}
    if p.type == "object":
        s.update(_object_schema(p.props, lang, True))
        s.pop("description")
        s = {"description": p.ja if lang == "ja" else p.en, **s}
    return s


def _object_schema(props: tuple[Prop, ...], lang: str, strict: bool) -> dict[str, Any]:
    s: dict[str, Any] = {
        "type": "object",
        "properties": {p.key: _prop_schema(p, lang) for p in props},
        "required": [p.key for p in props if p.required],
    }
    if strict:
        s["additionalProperties"] = False
    return s


S, I, N, B, A, O = "string", "integer", "number", "boolean", "array", "object"

TRAIN_TOOLS: tuple[Tool, ...] = (
    Tool("get_weather", "指定した都市の天気予報を取得する", "Get the weather forecast for a city", (
        Prop("city", S, "都市名", "city name", "city"),
        Prop("date", S, "日付 (YYYY-MM-DD)", "date (YYYY-MM-DD)", "date"),
        Prop("unit", S, "温度の単位", "temperature unit", enum=("celsius", "fahrenheit"), required=False),
    ), result_keys=("forecast", "temperature")),
    Tool("book_meeting_room", "会議室を予約する", "Book a meeting room", (
        Prop("room", S, "会議室名", "room name", "room"),
        Prop("date", S, "予約日", "booking date", "date"),
        Prop("start_time", S, "開始時刻 (HH:MM)", "start time (HH:MM)", "time"),
        Prop("attendees", I, "参加人数", "number of attendees", minimum=1, maximum=30),
    ), strict=True, result_keys=("reservation_id", "status")),
    Tool("send_email", "メールを送信する", "Send an email", (
        Prop("to", S, "宛先メールアドレス", "recipient email address", "email"),
        Prop("subject", S, "件名", "subject line", "subject"),
        Prop("body", S, "本文", "message body", "sentence"),
        Prop("cc", A, "CC の宛先一覧", "list of CC addresses", "email", required=False),
    ), result_keys=("message_id", "status")),
    Tool("search_documents", "社内文書を検索する", "Search internal documents", (
        Prop("query", S, "検索キーワード", "search keywords", "keyword"),
        Prop("max_results", I, "最大件数", "maximum number of results", minimum=1, maximum=50),
        Prop("department", S, "部署名", "department", "dept", required=False),
    ), result_keys=("hits", "total")),
    Tool("create_invoice", "請求書を作成する", "Create an invoice", (
        Prop("customer", S, "顧客名", "customer name", "company"),
        Prop("amount", N, "請求金額 (円)", "amount in yen", minimum=1000, maximum=5000000),
        Prop("due_date", S, "支払期限", "payment due date", "date"),
        Prop("tax_included", B, "税込みかどうか", "whether tax is included"),
    ), strict=True, result_keys=("invoice_id", "status")),
    Tool("convert_currency", "通貨を換算する", "Convert an amount between currencies", (
        Prop("amount", N, "金額", "amount", minimum=1, maximum=1000000),
        Prop("from_currency", S, "換算元の通貨", "source currency", enum=("JPY", "USD", "EUR", "CNY")),
        Prop("to_currency", S, "換算先の通貨", "target currency", enum=("JPY", "USD", "EUR", "CNY")),
    ), result_keys=("converted", "rate")),
    Tool("create_task", "タスクを登録する", "Create a task", (
        Prop("title", S, "タスク名", "task title", "task"),
        Prop("assignee", S, "担当者", "assignee", "person"),
        Prop("priority", S, "優先度", "priority", enum=("low", "medium", "high")),
        Prop("due_date", S, "期限", "due date", "date", required=False),
    ), strict=True, result_keys=("task_id", "status")),
    Tool("get_stock_price", "株価を取得する", "Get a stock price", (
        Prop("ticker", S, "銘柄コード", "ticker symbol", "ticker"),
        Prop("exchange", S, "取引所", "stock exchange", enum=("TSE", "NYSE", "NASDAQ")),
    ), result_keys=("price", "currency")),
    Tool("translate_text", "文章を翻訳する", "Translate text", (
        Prop("text", S, "翻訳する文章", "text to translate", "sentence"),
        Prop("target_language", S, "翻訳先の言語", "target language", enum=("ja", "en", "zh", "ko", "fr")),
    ), result_keys=("translation",)),
    Tool("schedule_call", "電話会議を設定する", "Schedule a conference call", (
        Prop("participants", A, "参加者の名前", "participant names", "person"),
        Prop("date", S, "日付", "date", "date"),
        Prop("duration_minutes", I, "所要時間 (分)", "duration in minutes", minimum=15, maximum=180),
        Prop("record", B, "録画するかどうか", "whether to record the call", required=False),
    ), result_keys=("call_id", "status")),
    Tool("lookup_customer", "顧客情報を照会する", "Look up a customer record", (
        Prop("customer_id", S, "顧客番号", "customer ID", "code"),
        Prop("include_history", B, "取引履歴を含めるか", "whether to include order history"),
    ), result_keys=("name", "status")),
    Tool("order_supplies", "備品を発注する", "Order office supplies", (
        Prop("item", S, "品名", "item name", "product"),
        Prop("quantity", I, "数量", "quantity", minimum=1, maximum=500),
        Prop("urgent", B, "至急かどうか", "whether the order is urgent", required=False),
    ), strict=True, result_keys=("order_id", "status")),
    Tool("get_exchange_schedule", "出張の交通手段を検索する", "Search travel connections", (
        Prop("origin", S, "出発地", "departure city", "city"),
        Prop("destination", S, "目的地", "destination city", "city"),
        Prop("date", S, "出発日", "departure date", "date"),
        Prop("mode", S, "交通手段", "means of transport", enum=("train", "plane", "bus")),
    ), result_keys=("departure", "arrival")),
    Tool("calculate_loan", "ローンの返済額を計算する", "Calculate loan repayments", (
        Prop("principal", N, "借入額 (円)", "principal in yen", minimum=100000, maximum=50000000),
        Prop("annual_rate", N, "年利 (%)", "annual interest rate (%)", minimum=0, maximum=15),
        Prop("years", I, "返済年数", "repayment period in years", minimum=1, maximum=35),
    ), result_keys=("monthly_payment",)),
    Tool("register_visitor", "来客を受付に登録する", "Register a visitor at reception", (
        Prop("visitor_name", S, "来訪者の氏名", "visitor name", "person"),
        Prop("company", S, "来訪者の会社名", "visitor's company", "company"),
        Prop("host", S, "面会する社員", "employee being visited", "person"),
        Prop("time", S, "来訪時刻", "arrival time", "time"),
    ), strict=True, result_keys=("badge_id", "status")),
    Tool("update_inventory", "在庫数を更新する", "Update stock levels", (
        Prop("sku", S, "商品コード", "product SKU", "code"),
        Prop("delta", I, "増減数", "change in quantity", minimum=-100, maximum=100),
        Prop("warehouse", S, "倉庫", "warehouse", enum=("tokyo", "osaka", "fukuoka")),
    ), result_keys=("stock", "status")),
    Tool("get_sales_report", "売上レポートを取得する", "Fetch a sales report", (
        Prop("period", S, "集計期間", "reporting period", enum=("daily", "weekly", "monthly", "quarterly")),
        Prop("region", S, "地域", "region", "region"),
        Prop("metrics", A, "集計する指標", "metrics to include", "metric", required=False),
    ), result_keys=("revenue", "growth")),
    Tool("file_expense", "経費を精算する", "File an expense claim", (
        Prop("employee", S, "社員名", "employee name", "person"),
        Prop("category", S, "費目", "expense category", enum=("travel", "meals", "supplies", "other")),
        Prop("amount", N, "金額 (円)", "amount in yen", minimum=100, maximum=300000),
        Prop("receipt", B, "領収書の有無", "whether a receipt is attached"),
    ), strict=True, result_keys=("claim_id", "status")),
    Tool("set_reminder", "リマインダーを設定する", "Set a reminder", (
        Prop("message", S, "通知内容", "reminder text", "task"),
        Prop("date", S, "日付", "date", "date"),
        Prop("time", S, "時刻", "time", "time"),
    ), result_keys=("reminder_id",)),
    Tool("check_package", "パッケージの情報を調べる", "Look up a Debian package", (
        Prop("package", S, "パッケージ名", "package name", "package"),
        Prop("release", S, "リリース名", "release codename", enum=("bookworm", "bullseye", "trixie", "sid")),
        Prop("show_dependencies", B, "依存関係を表示するか", "whether to list dependencies", required=False),
    ), result_keys=("version", "size")),
    Tool("reserve_restaurant", "飲食店を予約する", "Reserve a restaurant table", (
        Prop("restaurant", S, "店名", "restaurant name", "restaurant"),
        Prop("date", S, "日付", "date", "date"),
        Prop("time", S, "時刻", "time", "time"),
        Prop("party_size", I, "人数", "party size", minimum=1, maximum=20),
        Prop("contact", O, "連絡先", "contact details", props=(
            Prop("name", S, "氏名", "name", "person"),
            Prop("phone", S, "電話番号", "phone number", "phone"),
        )),
    ), result_keys=("reservation_id", "status")),
    Tool("create_user_account", "ユーザーアカウントを作成する", "Create a user account", (
        Prop("username", S, "ユーザー名", "user name", "username"),
        Prop("email", S, "メールアドレス", "email address", "email"),
        Prop("groups", A, "所属グループ", "groups", "group"),
        Prop("admin", B, "管理者権限を付与するか", "whether to grant admin rights", required=False),
    ), strict=True, result_keys=("uid", "status")),
    Tool("get_holiday_calendar", "祝日カレンダーを取得する", "Get the public holiday calendar", (
        Prop("country", S, "国コード", "country code", enum=("JP", "US", "DE", "CN")),
        Prop("year", I, "年", "year", minimum=2020, maximum=2030),
    ), result_keys=("holidays",)),
    Tool("submit_leave_request", "休暇を申請する", "Submit a leave request", (
        Prop("employee", S, "社員名", "employee name", "person"),
        Prop("start_date", S, "開始日", "first day", "date"),
        Prop("days", I, "日数", "number of days", minimum=1, maximum=20),
        Prop("reason", S, "理由", "reason", "reason", required=False),
    ), result_keys=("request_id", "status")),
)

HELDOUT_TOOLS: tuple[Tool, ...] = (
    Tool("get_air_quality", "指定した地域の大気汚染指数を取得する", "Get the air quality index for a place", (
        Prop("location", S, "地域名", "place name", "city"),
        Prop("pollutant", S, "汚染物質", "pollutant", enum=("pm25", "pm10", "ozone")),
    ), result_keys=("aqi",)),
    Tool("rent_car", "レンタカーを予約する", "Book a rental car", (
        Prop("pickup_city", S, "受取場所の都市", "pickup city", "city"),
        Prop("pickup_date", S, "受取日", "pickup date", "date"),
        Prop("days", I, "利用日数", "rental days", minimum=1, maximum=14),
        Prop("car_class", S, "車種クラス", "car class", enum=("compact", "sedan", "van")),
    ), strict=True, result_keys=("booking_id", "status")),
    Tool("post_announcement", "社内掲示板にお知らせを投稿する", "Post an announcement to the intranet", (
        Prop("headline", S, "見出し", "headline", "subject"),
        Prop("content", S, "本文", "body text", "sentence"),
        Prop("pinned", B, "上部に固定するか", "whether to pin it", required=False),
    ), result_keys=("post_id", "status")),
    Tool("estimate_shipping", "送料を見積もる", "Estimate a shipping cost", (
        Prop("destination", S, "配送先の都市", "destination city", "city"),
        Prop("weight_kg", N, "重量 (kg)", "weight in kg", minimum=0, maximum=50),
        Prop("express", B, "速達にするか", "whether to ship express"),
    ), strict=True, result_keys=("cost", "days")),
    Tool("assign_ticket", "問い合わせチケットを担当者に割り当てる", "Assign a support ticket", (
        Prop("ticket_id", S, "チケット番号", "ticket number", "code"),
        Prop("agent", S, "担当者名", "agent name", "person"),
        Prop("severity", S, "重要度", "severity", enum=("minor", "major", "critical")),
    ), result_keys=("status",)),
    Tool("plan_workshop", "研修を企画する", "Plan a training workshop", (
        Prop("topic", S, "研修テーマ", "workshop topic", "keyword"),
        Prop("date", S, "開催日", "date", "date"),
        Prop("capacity", I, "定員", "capacity", minimum=5, maximum=100),
        Prop("trainers", A, "講師の名前", "trainer names", "person"),
    ), strict=True, result_keys=("workshop_id", "status")),
    Tool("lookup_postal_code", "郵便番号から住所を調べる", "Look up an address by postal code", (
        Prop("postal_code", S, "郵便番号", "postal code", "postal"),
        Prop("include_romaji", B, "ローマ字表記を含めるか", "whether to include romaji", required=False),
    ), result_keys=("address",)),
    Tool("book_hotel", "ホテルを予約する", "Book a hotel room", (
        Prop("hotel_city", S, "宿泊する都市", "city of stay", "city"),
        Prop("check_in", S, "チェックイン日", "check-in date", "date"),
        Prop("nights", I, "泊数", "number of nights", minimum=1, maximum=14),
        Prop("guest", O, "宿泊者", "guest", props=(
            Prop("name", S, "氏名", "name", "person"),
            Prop("email", S, "メールアドレス", "email address", "email"),
        )),
    ), result_keys=("confirmation", "status")),
)


_POOLS: dict[str, tuple[str, ...]] = {
    "city": ("東京", "大阪", "名古屋", "札幌", "福岡", "仙台", "広島", "京都", "神戸", "横浜", "那覇", "金沢",
             "Tokyo", "Osaka", "Kyoto", "Sapporo", "London", "New York", "Paris", "Berlin", "Singapore"),
    "person": ("山田太郎", "佐藤花子", "鈴木一郎", "高橋美咲", "田中健", "伊藤優子", "渡辺誠", "中村彩",
               "小林翔", "加藤由美", "John Smith", "Emily Brown", "Li Wei", "Anna Müller"),
    "company": ("株式会社山田商事", "東和システム株式会社", "みなと物流株式会社", "青葉電機株式会社",
                "株式会社さくら銀行", "Acme Corp", "Globex Ltd", "Initech Inc"),
    "room": ("第1会議室", "第2会議室", "第3会議室", "大会議室", "応接室A", "応接室B", "Room 401", "Room 502"),
    "email": ("yamada@example.co.jp", "sato.hanako@example.com", "info@example.jp", "suzuki@example.org",
              "tanaka.k@example.co.jp", "sales@example.com", "john.smith@example.com"),
    "subject": ("会議日程のご連絡", "見積書送付のお願い", "新製品発表会のご案内", "定例会議の議事録",
                "システムメンテナンスのお知らせ", "Quarterly report", "Meeting follow-up", "Project update"),
    "keyword": ("経費精算 規程", "情報セキュリティ", "新人研修", "在宅勤務", "サーバ移行", "品質管理",
                "backup policy", "onboarding", "network setup"),
    "dept": ("営業部", "総務部", "経理部", "人事部", "開発部", "Sales", "Engineering"),
    "task": ("見積書の作成", "顧客への連絡", "議事録の共有", "契約書の確認", "資料の翻訳", "請求書の発行",
             "Prepare slides", "Review the contract", "Call the supplier"),
    "ticker": ("7203", "6758", "9984", "8306", "AAPL", "MSFT", "NVDA"),
    "code": ("C-10023", "C-20451", "INV-2024-0012", "SKU-4471", "T-99812", "A-00317", "K-55120"),
    "product": ("コピー用紙", "ボールペン", "トナーカートリッジ", "ホッチキス", "付箋", "ノートPC", "USBメモリ"),
    "region": ("関東", "関西", "九州", "北海道", "東北", "Asia", "Europe", "North America"),
    "metric": ("revenue", "units", "margin", "customers", "売上", "利益"),
    "package": ("aptitude", "coreutils", "openssh-server", "nginx", "python3", "git", "vim", "curl"),
    "restaurant": ("和食処さくら", "トラットリア・ソーレ", "中華飯店 龍", "焼肉やまと", "Cafe Lumiere"),
    "phone": ("03-1234-5678", "06-9876-5432", "090-1111-2222", "080-3333-4444", "052-123-4567"),
    "username": ("yamada", "hsato", "ksuzuki", "mtakahashi", "jsmith", "li.wei"),
    "group": ("staff", "sales", "admin", "developers", "finance", "hr"),
    "reason": ("私用のため", "家族の行事", "通院のため", "旅行", "personal matters", "medical appointment"),
    "postal": ("100-0001", "530-0001", "460-0008", "060-0001", "810-0001", "980-0021"),
}


def draw_value(p: Prop, rng: random.Random, sentences: list[str]) -> Any:
    """A random valid value for property `p` (`sentences` feeds free-text fields)."""
    if p.enum:
        return rng.choice(p.enum)
    if p.type == "integer":
        return rng.randint(p.minimum, p.maximum)
    if p.type == "number":
        if p.maximum - p.minimum > 1000:
            return rng.randrange(p.minimum, p.maximum, 100) if p.minimum % 100 == 0 else rng.randint(
                p.minimum, p.maximum)
        return round(rng.uniform(p.minimum, p.maximum), 1)
    if p.type == "boolean":
        return rng.random() < 0.5
    if p.type == "array":
        k = rng.randint(1, 3)
        if p.items == "string":
            return rng.sample(_POOLS[p.kind], k)
        return [rng.randint(p.minimum, p.maximum) for _ in range(k)]
    if p.type == "object":
        return {q.key: draw_value(q, rng, sentences) for q in p.props}
    if p.kind == "date":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if p.kind == "time":
        return f"{rng.randint(8, 19):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    if p.kind == "sentence":
        return rng.choice(sentences)
    if p.kind in _POOLS:
        return rng.choice(_POOLS[p.kind])
    raise ValueError(f"tool property {p.key!r} has unknown value kind {p.kind!r}")


VERBS = (("get", "取得する", "Get"), ("create", "作成する", "Create"), ("update", "更新する", "Update"),
          ("delete", "削除する", "Delete"), ("search", "検索する", "Search for"), ("reserve", "予約する", "Reserve"),
          ("send", "送信する", "Send"), ("check", "確認する", "Check"), ("list", "一覧表示する", "List"),
          ("register", "登録する", "Register"), ("cancel", "取り消す", "Cancel"), ("approve", "承認する", "Approve"))
NOUNS = (("invoice", "請求書", "an invoice"), ("order", "注文", "an order"), ("meeting", "会議", "a meeting"),
          ("report", "報告書", "a report"), ("contract", "契約", "a contract"), ("shipment", "出荷", "a shipment"),
          ("device", "端末", "a device"), ("budget", "予算", "a budget"), ("server", "サーバ", "a server"),
          ("backup", "バックアップ", "a backup"), ("customer", "顧客", "a customer"), ("product", "製品", "a product"),
          ("event", "イベント", "an event"), ("payment", "支払い", "a payment"),
          ("project", "プロジェクト", "a project"),
          ("account", "口座", "an account"), ("document", "文書", "a document"), ("survey", "アンケート", "a survey"),
          ("license", "ライセンス", "a license"), ("vendor", "取引先", "a vendor"))


def procedural_tools(n: int, seed: int) -> tuple[Tool, ...]:
    """`n` distinct tools composed from verbs x nouns x the argument pool of TRAIN_TOOLS.

    Hundreds of names and argument combinations make memorising a schema useless: the only way to write
    a valid call is to read the declaration, which is what the held-out evaluation asks for. Names and
    schemas of HELDOUT_TOOLS are never produced.
    """
    rng = random.Random(seed)
    pool: dict[str, Prop] = {}
    for t in TRAIN_TOOLS:
        for p in t.props:
            pool.setdefault(p.key, p)
    keys = sorted(pool)
    names = [(v, nn) for v in VERBS for nn in NOUNS]
    heldout = {t.name for t in HELDOUT_TOOLS} | {t.name for t in TRAIN_TOOLS}
    names = [x for x in names if f"{x[0][0]}_{x[1][0]}" not in heldout]
    if n > len(names):
        raise ValueError(f"at most {len(names)} procedural tools can be made, {n} requested")
    out = []
    for (verb, noun) in rng.sample(names, n):
        chosen = rng.sample(keys, rng.randint(1, 4))
        props = tuple(Prop(**{**pool[k].__dict__, "required": i == 0 or rng.random() < 0.6})
                      for i, k in enumerate(chosen))
        out.append(Tool(f"{verb[0]}_{noun[0]}", f"{noun[1]}を{verb[1]}", f"{verb[2]} {noun[2]}", props,
                        strict=rng.random() < 0.5, result_keys=(f"{noun[0]}_id", "status")))
    return tuple(out)
