from django.urls import include, path
from rest_framework.routers import DefaultRouter

from jobs.fleet import api as fleet_api, views as fleet_views
from jobs.runs import api as runs_api, views as runs_views, views_compare
from jobs.scheduling import api as scheduling_api, views as scheduling_views
from jobs.access import api as api_auth
from jobs.planning import api as api_calibration, api as api_knowledge, api as api_plan, views as views_knowledge
from jobs.bundles import api as api_code
from jobs.experiments import api as experiments_api, views as experiments_views
from jobs.telemetry import api_retention, api_series, views as views_relay
from jobs.notify import api as notify_api, views as notify_views

router = DefaultRouter()
router.register("jobs", runs_api.JobViewSet, basename="api-job")
router.register("nodes", fleet_api.NodeViewSet, basename="api-node")
router.register("experiments", experiments_api.ExperimentViewSet, basename="api-experiment")

urlpatterns = [
    path("", runs_views.overview, name="overview"),
    path("jobs/", runs_views.job_list, name="job-list"),
    path("jobs/new/", runs_views.job_new, name="job-new"),
    path("jobs/<int:pk>/", runs_views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/cancel/", runs_views.job_cancel, name="job-cancel"),
    path("compare/", views_compare.compare, name="compare"),
    path("experiments/", experiments_views.experiment_list, name="experiment-list"),
    path("experiments/new/", experiments_views.experiment_new, name="experiment-new"),
    path("experiments/<int:pk>/", experiments_views.experiment_detail, name="experiment-detail"),
    path("experiments/<int:pk>/stop/", experiments_views.experiment_stop, name="experiment-stop"),
    path("experiments/<int:pk>/trials/<int:job_id>/continue/", experiments_views.trial_continue,
         name="experiment-trial-continue"),
    path("jobs/<int:pk>/annotate/", runs_views.job_annotate, name="job-annotate"),
    path("nodes/", fleet_views.node_list, name="node-list"),
    path("nodes/control-plane/", fleet_views.control_plane, name="control-plane"),
    path("quotas/", scheduling_views.quota_list, name="quota-list"),
    path("knowledge/", views_knowledge.knowledge_page, name="knowledge"),
    path("relay/dead-letters/", views_relay.dead_letters, name="relay-dead-letters"),
    path("api/v1/auth/token/", api_auth.AuthTokenView.as_view(), name="api-auth-token"),
    path("api/v1/quotas/", scheduling_api.QuotaView.as_view(), name="api-quotas"),
    path("api/v1/knowledge/", api_knowledge.KnowledgeView.as_view(), name="api-knowledge"),
    path("api/v1/code/", api_code.CodeUploadView.as_view(), name="api-code"),
    path("api/v1/plan/", api_plan.PlanView.as_view(), name="api-plan"),
    path("api/v1/code/<str:digest>/", api_code.CodeDetailView.as_view(), name="api-code-detail"),
    path("api/v1/calibrations/", api_calibration.CalibrationView.as_view(), name="api-calibrations"),
    path("api/v1/jobs/<int:pk>/series/", api_series.JobSeriesView.as_view(), name="api-job-series"),
    path("api/v1/jobs/<int:pk>/ranks/", api_series.JobRanksView.as_view(), name="api-job-ranks"),
    path("api/v1/series/", api_series.SeriesView.as_view(), name="api-series"),
    path("api/v1/series/metrics/", api_series.SeriesMetricsView.as_view(), name="api-series-metrics"),
    path("api/v1/retention/", api_retention.RetentionView.as_view(), name="api-retention"),
    path("notifications/", notify_views.notifications, name="notifications"),
    path("api/v1/webhooks/", notify_api.WebhookListView.as_view(), name="api-webhooks"),
    path("api/v1/webhooks/<int:pk>/", notify_api.WebhookDetailView.as_view(), name="api-webhook"),
    path("api/v1/webhooks/<int:pk>/deliveries/", notify_api.WebhookDeliveryListView.as_view(),
         name="api-webhook-deliveries"),
    path("api/v1/subscriptions/", notify_api.SubscriptionListView.as_view(), name="api-subscriptions"),
    path("api/v1/subscriptions/<int:pk>/", notify_api.SubscriptionDetailView.as_view(), name="api-subscription"),
    path("api/v1/subscriptions/<int:pk>/deliveries/", notify_api.SubscriptionDeliveryListView.as_view(),
         name="api-subscription-deliveries"),
    path("api/v1/", include(router.urls)),
]
