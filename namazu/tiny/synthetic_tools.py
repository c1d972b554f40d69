"""Freshly composed tool schemas, one set per training transcript.

A fixed pool of schemas, however large, can be memorised: a model trained on 224 schemas learned to write
the names and keys it had seen instead of the declared ones, and every call on a never-seen schema failed
validation. Here each transcript declares tools whose names, property keys, descriptions, types, ranges
and enums are drawn anew from a combinatorial space (tens of thousands of keys, hundreds of thousands of
names), so the only way to predict a call is to read it off the declaration and the request. Names and
keys of `tools.HELDOUT_TOOLS` are never produced, so the held-out evaluation stays unseen.
"""
from __future__ import annotations

import random

from namazu.tiny import tools as base
from namazu.tiny.tools import HELDOUT_TOOLS, TRAIN_TOOLS, Prop, Tool

# (name part, Japanese predicate, English imperative)
VERBS = base.VERBS + (
    ("calculate", "計算する", "Calculate"), ("submit", "提出する", "Submit"), ("publish", "公開する", "Publish"),
    ("archive", "保管する", "Archive"), ("export", "出力する", "Export"), ("import", "取り込む", "Import"),
    ("notify", "通知する", "Notify about"), ("renew", "更新手続きをする", "Renew"), ("order", "発注する", "Order"),
    ("transfer", "移管する", "Transfer"), ("verify", "検証する", "Verify"), ("measure", "計測する", "Measure"),
    ("analyze", "分析する", "Analyze"), ("review", "確認・審査する", "Review"), ("track", "追跡する", "Track"),
    ("find", "探す", "Find"), ("issue", "発行する", "Issue"), ("close", "締める", "Close"),
    ("open", "開設する", "Open"), ("summarize", "要約する", "Summarize"), ("compare", "比較する", "Compare"),
    ("forecast", "予測する", "Forecast"), ("print", "印刷する", "Print"), ("share", "共有する", "Share"),
    ("quote", "見積もる", "Quote"), ("fetch", "取り寄せる", "Fetch"), ("reset", "初期化する", "Reset"),
    ("approve_bulk", "一括承認する", "Bulk-approve"),
)
# (name part, Japanese noun, English noun phrase)
NOUNS = base.NOUNS + (
    ("employee", "社員", "an employee"),
    ("parcel", "荷物", "a parcel"), ("warehouse", "倉庫", "a warehouse"), ("seminar", "セミナー", "a seminar"),
    ("campaign", "キャンペーン", "a campaign"), ("refund", "返金", "a refund"),
    ("password", "パスワード", "a password"),
    ("badge", "入館証", "a badge"), ("parking", "駐車場", "a parking space"), ("equipment", "機材", "equipment"),
    ("notice", "お知らせ", "a notice"), ("memo", "メモ", "a memo"), ("file", "ファイル", "a file"),
    ("folder", "フォルダ", "a folder"), ("database", "データベース", "a database"),
    ("printer", "プリンタ", "a printer"),
    ("delivery", "配送", "a delivery"), ("inquiry", "問い合わせ", "an inquiry"), ("complaint", "苦情", "a complaint"),
    ("receipt", "領収書", "a receipt"), ("salary", "給与", "a salary"), ("attendance", "勤怠", "attendance"),
    ("interview", "面接", "an interview"), ("candidate", "候補者", "a candidate"), ("office", "事務所", "an office"),
    ("branch", "支店", "a branch"), ("store", "店舗", "a store"), ("flight", "航空便", "a flight"),
    ("train_ticket", "乗車券", "a train ticket"), ("taxi", "タクシー", "a taxi"), ("forecast", "予報", "a forecast"),
    ("stock", "在庫", "stock"), ("price", "価格", "a price"), ("coupon", "クーポン", "a coupon"),
    ("member", "会員", "a member"), ("calendar", "カレンダー", "a calendar"), ("alert", "警報", "an alert"),
    ("log", "ログ", "a log"), ("dashboard", "ダッシュボード", "a dashboard"), ("policy", "規程", "a policy"),
    ("asset", "資産", "an asset"), ("visitor", "来客", "a visitor"), ("expense", "経費", "an expense"),
    ("timesheet", "工数表", "a timesheet"), ("quotation", "見積書", "a quotation"), ("lecture", "講義", "a lecture"),
    ("supplier", "仕入先", "a supplier"), ("loan", "融資", "a loan"), ("insurance", "保険", "insurance"),
    ("claim", "請求", "a claim"), ("contract_draft", "契約書案", "a contract draft"), ("label", "ラベル", "a label"),
    ("vehicle", "車両", "a vehicle"), ("route", "経路", "a route"), ("bill", "明細", "a bill"),
)

# Property "bases" per value kind: (key, Japanese description, English description).
_BASES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "city": (("city", "都市", "city"), ("location", "場所", "location"), ("place", "地点", "place"),
             ("town", "町", "town"), ("area", "エリア", "area")),
    "person": (("name", "氏名", "name"), ("person", "人物", "person"), ("manager", "責任者", "manager"),
               ("staff", "担当者", "staff member"), ("owner", "所有者", "owner"), ("contact", "連絡担当", "contact"),
               ("reviewer", "確認者", "reviewer")),
    "company": (("company", "会社名", "company"), ("client", "取引先名", "client"), ("firm", "企業", "firm"),
                ("organization", "組織名", "organization")),
    "room": (("room", "部屋", "room"), ("venue", "会場", "venue"), ("space", "スペース", "space")),
    "email": (("email", "メールアドレス", "email address"), ("mail", "メール", "mail address"),
              ("address", "アドレス", "address")),
    "subject": (("subject", "件名", "subject"), ("title", "タイトル", "title"), ("heading", "見出し語", "heading")),
    "keyword": (("keyword", "キーワード", "keyword"), ("query", "検索語", "query"), ("theme", "テーマ", "theme"),
                ("term", "用語", "term")),
    "dept": (("department", "部署", "department"), ("division", "部門", "division"), ("team", "チーム", "team"),
             ("section", "課", "section")),
    "task": (("task", "作業", "task"), ("todo", "やること", "to-do"), ("action", "対応", "action")),
    "code": (("code", "コード", "code"), ("id", "番号", "ID"), ("number", "番号", "number"),
             ("reference", "参照番号", "reference"), ("serial", "シリアル番号", "serial number")),
    "product": (("item", "品目", "item"), ("product", "商品", "product"), ("article", "物品", "article")),
    "region": (("region", "地方", "region"), ("zone", "区域", "zone"), ("market", "市場", "market")),
    "phone": (("phone", "電話番号", "phone number"), ("tel", "電話", "telephone"), ("mobile", "携帯番号", "mobile")),
    "username": (("username", "ユーザー名", "user name"), ("login", "ログイン名", "login"),
                 ("handle", "ハンドル", "handle")),
    "group": (("group", "グループ", "group"), ("role", "ロール", "role"), ("unit", "ユニット", "unit")),
    "reason": (("reason", "理由", "reason"), ("note", "備考", "note"), ("purpose", "目的", "purpose")),
    "postal": (("zip", "郵便番号", "ZIP code"), ("postcode", "〒番号", "postcode")),
    "date": (("date", "日付", "date"), ("day", "日", "day"), ("deadline", "締切日", "deadline"),
             ("start_date", "開始日", "start date"), ("end_date", "終了日", "end date"), ("on", "実施日", "date of")),
    "time": (("time", "時刻", "time"), ("start_time", "開始時刻", "start time"), ("end_time", "終了時刻", "end time"),
             ("at", "予定時刻", "time of")),
    "sentence": (("message", "メッセージ", "message"), ("text", "文章", "text"), ("comment", "コメント", "comment"),
                 ("description", "説明", "description"), ("body", "本文", "body"), ("summary", "概要", "summary")),
}
_INT_BASES = (("count", "件数", "count"), ("quantity", "数量", "quantity"), ("limit", "上限数", "limit"),
              ("minutes", "分数", "minutes"), ("days", "日数", "days"), ("seats", "席数", "seats"),
              ("people", "人数", "number of people"), ("level", "レベル", "level"), ("year", "年", "year"),
              ("page", "ページ数", "pages"), ("retries", "再試行回数", "retries"), ("rank", "順位", "rank"))
_NUM_BASES = (("amount", "金額", "amount"), ("price", "価格", "price"), ("weight", "重量", "weight"),
              ("ratio", "比率", "ratio"), ("score", "スコア", "score"), ("distance", "距離", "distance"),
              ("rate", "レート", "rate"), ("temperature", "温度", "temperature"), ("length", "長さ", "length"))
_BOOL_BASES = (("urgent", "至急かどうか", "whether it is urgent"), ("notify", "通知するか", "whether to notify"),
               ("public", "公開するか", "whether it is public"), ("confirmed", "確定済みか", "whether confirmed"),
               ("dry_run", "試行のみか", "whether this is a dry run"), ("archive", "保管するか", "whether to archive"),
               ("recurring", "繰り返すか", "whether it repeats"), ("paid", "支払済みか", "whether paid"),
               ("verbose", "詳細を出すか", "whether to give details"), ("include_all", "全件含めるか",
                                                                    "whether to include everything"))
_ENUMS = (("priority", "優先度", "priority", ("low", "medium", "high")),
          ("status", "状態", "status", ("open", "pending", "closed")),
          ("size", "サイズ", "size", ("small", "medium", "large")),
          ("language", "言語", "language", ("ja", "en", "zh", "ko")),
          ("color", "色", "color", ("red", "blue", "green", "black")),
          ("format", "形式", "format", ("pdf", "csv", "xlsx")),
          ("plan", "プラン", "plan", ("basic", "standard", "premium")),
          ("channel", "経路", "channel", ("email", "phone", "chat")),
          ("frequency", "頻度", "frequency", ("daily", "weekly", "monthly")),
          ("tier", "ランク", "tier", ("bronze", "silver", "gold")),
          ("mode", "方式", "mode", ("auto", "manual")),
          ("level", "水準", "level", ("A", "B", "C", "D")),
          ("season", "季節", "season", ("spring", "summer", "autumn", "winter")),
          ("currency", "通貨", "currency", ("JPY", "USD", "EUR")),
          ("direction", "方向", "direction", ("inbound", "outbound")))
# Qualifiers make keys compound ("billing_city"); (key, Japanese prefix, English adjective).
_QUALS = (("origin", "出発", "origin"), ("target", "対象", "target"), ("primary", "主", "primary"),
          ("backup", "予備の", "backup"), ("new", "新しい", "new"), ("old", "旧", "old"), ("main", "メイン",
                                                                                         "main"),
          ("sender", "送信者の", "sender"), ("recipient", "受信者の", "recipient"), ("billing", "請求先",
                                                                                 "billing"),
          ("shipping", "配送先", "shipping"), ("home", "自宅の", "home"), ("office", "勤務先の", "office"),
          ("team", "チームの", "team"), ("parent", "親", "parent"), ("final", "最終", "final"),
          ("initial", "初回", "initial"), ("max", "最大", "maximum"), ("min", "最小", "minimum"),
          ("expected", "予定", "expected"), ("actual", "実績", "actual"), ("customer", "顧客の", "customer"),
          ("vendor", "業者の", "vendor"), ("event", "イベントの", "event"), ("request", "依頼", "request"),
          ("return", "返却", "return"), ("pickup", "集荷", "pickup"), ("report", "報告", "report"),
          ("trial", "試用", "trial"), ("local", "現地", "local"), ("guest", "来客の", "guest"))

_RESERVED_NAMES = {t.name for t in HELDOUT_TOOLS} | {t.name for t in TRAIN_TOOLS}
_TRAIN_KEYS = {p.key for t in TRAIN_TOOLS for p in t.props}
_RESERVED_KEYS = {p.key for t in HELDOUT_TOOLS for p in t.props} - _TRAIN_KEYS
_RESERVED_KEYS |= {q.key for t in HELDOUT_TOOLS for p in t.props for q in p.props} - _TRAIN_KEYS


def _style(key: str, rng: random.Random) -> str:
    # Mostly snake_case like most real schemas; some camelCase so copying works per character, not per word.
    if rng.random() < 0.12:
        head, *rest = key.split("_")
        return head + "".join(w.capitalize() for w in rest)
    return key


def _compound(base: tuple[str, str, str], rng: random.Random, p_qual: float = 0.5) -> tuple[str, str, str]:
    if rng.random() >= p_qual:
        return base
    q = rng.choice(_QUALS)
    return f"{q[0]}_{base[0]}", f"{q[1]}{base[1]}", f"{q[2]} {base[2]}"


def _range(rng: random.Random, lo_choices: tuple[int, ...], span_choices: tuple[int, ...]) -> tuple[int, int]:
    lo = rng.choice(lo_choices)
    return lo, lo + rng.choice(span_choices)


def synthetic_prop(rng: random.Random, depth: int = 0) -> Prop:
    """One property with a fresh key: kind, type and range are random, descriptions match the key."""
    r = rng.random()
    if r < 0.42:
        kind = rng.choice(tuple(_BASES))
        key, ja, en = _compound(rng.choice(_BASES[kind]), rng)
        return Prop(key, "string", ja, en, kind)
    if r < 0.56:
        key, ja, en = _compound(rng.choice(_INT_BASES), rng)
        lo, hi = _range(rng, (0, 1, 5, 10, 100), (5, 10, 30, 50, 100, 1000))
        return Prop(key, "integer", ja, en, minimum=lo, maximum=hi)
    if r < 0.66:
        key, ja, en = _compound(rng.choice(_NUM_BASES), rng)
        lo, hi = _range(rng, (0, 1, 10, 1000), (10, 100, 500, 10000, 1000000))
        return Prop(key, "number", ja, en, minimum=lo, maximum=hi)
    if r < 0.76:
        key, ja, en = _compound(rng.choice(_BOOL_BASES), rng, 0.2)
        return Prop(key, "boolean", ja, en)
    if r < 0.90:
        key, ja, en, values = rng.choice(_ENUMS)
        key, ja, en = _compound((key, ja, en), rng, 0.4)
        k = rng.randint(2, len(values))
        return Prop(key, "string", ja, en, enum=tuple(rng.sample(values, k)))
    if r < 0.96 or depth > 0:
        kind = rng.choice(("person", "email", "city", "code", "group", "product", "dept", "keyword"))
        key, ja, en = rng.choice(_BASES[kind])
        return Prop(key + "s" if not key.endswith("s") else key + "_list", "array", ja + "一覧", en + " list", kind)
    key, ja, en = _compound(rng.choice((("contact", "連絡先", "contact"), ("owner", "所有者情報", "owner"),
                                        ("address", "住所情報", "address"), ("sender", "送付元", "sender"),
                                        ("details", "詳細", "details"))), rng, 0.3)
    members = _distinct_props(rng, rng.randint(2, 3), depth + 1)
    return Prop(key, "object", ja, en, props=members)


def _distinct_props(rng: random.Random, n: int, depth: int = 0) -> tuple[Prop, ...]:
    out: list[Prop] = []
    seen: set[str] = set()
    while len(out) < n:
        p = synthetic_prop(rng, depth)
        key = _style(p.key, rng)
        if key in seen or key in _RESERVED_KEYS:
            continue
        seen.add(key)
        out.append(Prop(**{**p.__dict__, "key": key, "required": not out or rng.random() < 0.7}))
    return tuple(out)


def synthetic_tool(rng: random.Random) -> Tool:
    """A tool never seen before: name, description, 1-5 properties, strictness all drawn from `rng`."""
    while True:
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        name = f"{verb[0]}_{noun[0]}"
        ja, en = f"{noun[1]}を{verb[1]}", f"{verb[2]} {noun[2]}"
        if rng.random() < 0.35:  # a qualifier widens the name space and makes names longer, like real APIs
            q = rng.choice(_QUALS)
            name, ja, en = f"{verb[0]}_{q[0]}_{noun[0]}", f"{q[1]}{noun[1]}を{verb[1]}", \
                f"{verb[2]} {q[2]} {noun[2].split(' ', 1)[-1]}"
        name = _style(name, rng)
        if name not in _RESERVED_NAMES:
            break
    props = _distinct_props(rng, rng.randint(1, 5))
    return Tool(name, ja, en, props, strict=rng.random() < 0.5, result_keys=(f"{noun[0]}_id", "status"))


def synthetic_tools(rng: random.Random, n: int) -> tuple[Tool, ...]:
    """`n` tools with distinct names (one transcript's declarations)."""
    out: dict[str, Tool] = {}
    while len(out) < n:
        t = synthetic_tool(rng)
        out.setdefault(t.name, t)
    return tuple(out.values())
